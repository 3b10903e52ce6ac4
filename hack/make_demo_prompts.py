#!/usr/bin/env python3
"""Generate examples/prompts/swe.jsonl: long, SWE-agent-like prompts for the demo's B8_sweagent dataset.

Each row is a system message (an agent scaffold with tool instructions) and a user message (an issue plus code
context: repository layout, source files, a stack trace or failing test output, recent commits). The data is in
hack/demo_prompts/: `scenarios/*.yaml` are fictional projects in Python, Go, TypeScript/JavaScript and Rust, each
with its own bug, written for tokenmill; `scaffolds.yaml` holds the three agent scaffolds and the per-language
details. Every scenario is rendered three ways (different agent scaffold, framing and context), so no two rows
share the same prompt. The output is deterministic (tests/unit/test_demo_prompts.py regenerates it):

    .venv/bin/python hack/make_demo_prompts.py [--out examples/prompts/swe.jsonl]

The function-calling and reasoning prompt files are hand-written JSONL and are not produced by this script.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "hack" / "demo_prompts"
DEFAULT_OUT = ROOT / "examples" / "prompts" / "swe.jsonl"
VIEWER_WINDOW = 100  # lines the ACI scaffold's file viewer shows
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader when PyYAML has it: 10x faster


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceFile(Strict):
    path: str
    content: str


class Scenario(Strict):
    repo: str  # owner/name
    lang: str  # a key of scaffolds.yaml languages
    test_cmd: str
    title: str
    issue: str
    tree: str
    files: list[SourceFile]  # the first is the file the SWE-agent framing leaves open
    trace: str
    test: SourceFile  # the failing regression test
    test_output: str
    commits: list[str]


class Language(Strict):
    toolchain: str
    fence: str  # the code-fence info string for this language's files
    run_example: str


class System(Strict):
    name: str
    template: str  # str.format placeholders: repo, workdir, window, toolchain, lang, test_cmd, run_example


class Scaffolds(Strict):
    languages: dict[str, Language]
    systems: list[System]


def _load(path: Path, model: type[Strict]) -> Any:
    try:
        return model.model_validate(yaml.load(path.read_text(encoding="utf-8"), Loader=_LOADER))
    except (ValidationError, yaml.YAMLError) as error:
        raise SystemExit(f"{path}: {error}") from None


def load_data(data: Path = DATA) -> tuple[Scaffolds, list[Scenario]]:
    """The scaffolds and the scenarios (in file-name order), checked: every scenario's language is known."""
    scaffolds = _load(data / "scaffolds.yaml", Scaffolds)
    scenarios = []
    for path in sorted((data / "scenarios").glob("*.yaml")):
        scenario = _load(path, Scenario)
        if scenario.lang not in scaffolds.languages:
            raise SystemExit(f"{path}: lang {scenario.lang!r} is not one of "
                             f"{sorted(scaffolds.languages)} (scaffolds.yaml languages)")
        scenarios.append(scenario)
    return scaffolds, scenarios


# ----------------------------------------------------------------------------------------------------------------
# Rendering: three framings of the same scenario


def dedent(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def fence_for(path: str, language: Language) -> str:
    for suffix, name in ((".md", "markdown"), (".toml", "toml"), (".yaml", "yaml"), (".json", "json")):
        if path.endswith(suffix):
            return name
    return language.fence


def numbered(code: str) -> str:
    lines = code.split("\n")
    width = len(str(len(lines)))
    return "\n".join(f"{i:>{width}}:{line}" for i, line in enumerate(lines, 1))


def workdir(sc: Scenario) -> str:
    return "/repo" if sc.lang == "Python" else "/workspace/" + sc.repo.split("/")[1]


def render_system(scaffolds: Scaffolds, sc: Scenario, style: int) -> str:
    language = scaffolds.languages[sc.lang]
    return scaffolds.systems[style].template.format(
        repo=sc.repo, workdir=workdir(sc), window=VIEWER_WINDOW, toolchain=language.toolchain, lang=sc.lang,
        test_cmd=sc.test_cmd, run_example=language.run_example,
    )


def frame_issue_with_files(sc: Scenario, language: Language) -> str:
    """SWE-agent style: the issue, the layout and line-numbered files, then a shell prompt."""
    parts = [
        "We're currently solving the following issue within our repository. Here's the issue text:",
        f"ISSUE:\n{sc.title}\n\n{sc.issue}",
        dedent("""
            INSTRUCTIONS:
            Now you're going to solve this issue on your own, with the tools described above. Edit the files you
            need to, run anything you like, and when you are confident the issue is fixed, submit your changes.
            Note that the environment does NOT support interactive session commands. Reproduce the issue first:
            if it does not reproduce, find out why before changing code. Tests live next to the code they test.

            A teammate looked at this before you and left the repository layout and the files they suspect.
            Their notes may be incomplete or wrong.
        """),
        "Repository layout (truncated):\n" + sc.tree,
    ]
    for file in [*sc.files, sc.test]:
        total = file.content.count("\n") + 1
        parts.append(f"[File: {workdir(sc)}/{file.path} ({total} lines total)]\n{numbered(file.content)}")
    last = sc.files[0].path
    parts.append(f"(Open file: {workdir(sc)}/{last})\n(Current directory: {workdir(sc)})\nbash-$")
    return "\n\n".join(parts)


def frame_uploaded(sc: Scenario, language: Language) -> str:
    """OpenHands style: uploaded repository, issue description, error output and relevant files."""
    parts = [
        f"<uploaded_files>\n{workdir(sc)}\n</uploaded_files>",
        f"I've uploaded a {sc.lang} code repository in the directory {workdir(sc)}. Consider the following issue "
        "description:",
        f"<issue_description>\n# {sc.title}\n\n{sc.issue}\n</issue_description>",
        dedent("""
            Can you help me implement the necessary changes to the repository so that the requirements in the
            <issue_description> are met? Any test changes the issue needs are mine to make, so focus on the
            non-test files. Keep the change as small as the fix allows.

            Follow these steps:
            1. Explore the repository to understand how the affected code is structured and called.
            2. Write a script that reproduces the problem and run it to confirm the failure.
            3. Edit the source code to fix the problem.
            4. Rerun your script and confirm the fix; think about edge cases and make sure the fix covers them.

            Here is the error output I captured:
        """),
        f"<error_output>\n{sc.trace}\n</error_output>",
        "And the files I believe are involved:",
    ]
    for file in sc.files:
        parts.append(f'<file path="{file.path}">\n```{fence_for(file.path, language)}\n{file.content}\n```\n</file>')
    parts.append(f"I also wrote a test for it, which currently fails (`{sc.test.path}`):")
    parts.append(f"```{fence_for(sc.test.path, language)}\n{sc.test.content}\n```")
    return "\n\n".join(parts)


def frame_ci(sc: Scenario, language: Language) -> str:
    """Maintainer style: CI is red; commits, failing test output, the test, and the code under test."""
    summary = sc.issue.split("\n\n")[0]
    parts = [
        f"CI on `main` of {sc.repo} is red. We added a regression test for the bug tracked as "
        f"\"{sc.title}\" and it fails, as expected. Now we need the fix. Recent history:",
        "```\n" + "\n".join(sc.commits) + "\n```",
        "From the report:\n\n> " + summary.replace("\n", "\n> "),
        "The failing job's output:",
        f"```\n{sc.test_output}\n```",
        f"The new test (`{sc.test.path}`):",
        f"```{fence_for(sc.test.path, language)}\n{sc.test.content}\n```",
        "Repository layout:\n" + sc.tree,
        "Code under test:",
    ]
    for file in sc.files:
        parts.append(f"`{file.path}`:\n```{fence_for(file.path, language)}\n{file.content}\n```")
    parts.append(dedent(f"""
        Please fix the library code so that the test passes without weakening it, and run `{sc.test_cmd}`
        plus the rest of the suite before you finish. If you think the test itself is wrong, explain why
        instead of changing it.
    """))
    return "\n\n".join(parts)


FRAMES = [frame_issue_with_files, frame_uploaded, frame_ci]


def build_rows(scaffolds: Scaffolds, scenarios: list[Scenario]) -> list[dict]:
    """Every scenario in every framing; scenario i in framing v uses agent scaffold (i + v) mod 3."""
    conversations = []
    for variant, frame in enumerate(FRAMES):
        for index, sc in enumerate(scenarios):
            style = (index + variant) % len(scaffolds.systems)
            conversations.append([
                {"role": "system", "content": render_system(scaffolds, sc, style)},
                {"role": "user", "content": frame(sc, scaffolds.languages[sc.lang])},
            ])
    # Interleave (a fixed permutation) so that neighbouring rows come from different projects and framings.
    count = len(conversations)
    order = sorted(range(count), key=lambda i: (i * 37) % count)
    return [{"sample_id": f"swe-{number:04d}", "messages": conversations[i]} for number, i in enumerate(order, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSONL file to write")
    args = parser.parse_args()
    rows = build_rows(*load_data())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    words = sorted(sum(len(m["content"].split()) for m in row["messages"]) for row in rows)
    print(f"wrote {len(rows)} rows to {args.out} (words per prompt: min {words[0]}, "
          f"median {words[len(words) // 2]}, max {words[-1]})")


if __name__ == "__main__":
    main()
