"""The first hour, as the docs tell it: every command of README.md, of docs/running.md (the first page docs/index.md
gives) and of examples/README.md, run on a fresh copy of the repository, ending with the exit code and the first
line the docs promise; and the exit codes a pipeline relies on, each asserted once.

One `make demo` run (its install skipped: the test's own environment stands in for it) makes out/demo, which every
command that reads it reuses. Servers the docs name (gpu-host, minio, the gateway) are stood in for by the simulator,
moto's S3 server and smg; a command that needs a cluster or is the test suite itself is listed with the test that
runs it instead. A command added to the docs without a contract here fails `test_every_documented_command_has_a_
contract`.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import yaml

from tests.conftest import REPO
from tokenmill_runner.cli import main
from tokenmill_runner.generate.summary import (
    EXIT_CODES,
    EXIT_NO_SAMPLES,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_VERDICT,
)

DOCS = ("README.md", "docs/running.md", "examples/README.md")
VENV_BIN = Path(sys.executable).parent
KIMI = REPO / "tests" / "fixtures" / "tokenizers" / "kimi-k2.5"
B5_URI = "s3://tokenmill-data/runs/b5-openthoughts/"


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str

    @property
    def first(self) -> str:
        return next((line for line in self.out.splitlines() if line.strip()), "")


def tokenmill(*args: str, cwd: Path) -> Ran:
    """`tokenmill ARGS` in this process (no interpreter start-up per command), from `cwd`."""
    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["-q", *args])
            except SystemExit as stop:  # argparse: a bad flag
                code = int(stop.code or 0)
    finally:
        os.chdir(here)
    return Ran(code, out.getvalue(), err.getvalue())


# -- what the docs say ----------------------------------------------------------------------------------------------
def documented_commands() -> list[str]:
    """Every command line of the docs' bash blocks (continuations joined, comments dropped, `.venv/bin/` left off),
    and the alternatives their comments offer (`# or: tokenmill run ...`)."""
    found: list[str] = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command, _, comment = line.partition(" #")
                alternative = comment.strip().removeprefix("or: ") if comment.strip().startswith("or: ") else ""
                for item in (command, alternative):
                    item = re.sub(r"\s+", " ", item.strip()).removeprefix(".venv/bin/")
                    if item and not item.startswith("#") and item not in found:
                        found.append(item)
    return found


# Run here, in this order: (command, exit code, pattern of the first line of stdout).
RUN: list[tuple[str, int, str]] = [
    ("make demo", EXIT_OK, r"^rm -rf out/demo$"),
    ("tokenmill report out/demo", EXIT_OK, r"^Report verdict: PASS$"),
    ("tokenmill inspect out/demo --longest 2", EXIT_OK, r"^══ \w+ · (sample|conversation) "),
    ("tokenmill export out/demo --format hf out/demo-hf", EXIT_OK, r"^dataset +units +written"),
    ("tokenmill inspect out/demo --dataset B1_glaive --shortest 3", EXIT_OK, r"^══ B1_glaive · sample "),
    ("tokenmill inspect out/demo --sample fc-0014 --json", EXIT_OK, r"^\[$"),
    ("tokenmill inspect out/demo --dataset B8_sweagent --sample swe-0007", EXIT_OK,
     r"^══ B8_sweagent · sample swe-0007 "),
    # Offline: no store answers (plan must not need one for the models the examples name).
    ("tokenmill plan examples/b5-openthoughts.yaml", EXIT_OK, r"."),
    ("tokenmill plan b5.yaml", EXIT_OK, r"."),
    # One machine against a server: the README's b5 spec, S3 on moto, gpu-host the simulator with Kimi's tokenizer.
    ("tokenmill run b5.yaml --server http://gpu-host:30000", EXIT_OK, r"^dataset +slots "),
    (f"tokenmill report {B5_URI}", EXIT_OK, r"^Report verdict: (PASS|WARN)$"),
    (f"tokenmill inspect {B5_URI} --longest 2 --trust-remote-code", EXIT_OK, r"^══ B5_openthoughts · sample "),
    (f"tokenmill inspect {B5_URI} --random 3 --trust-remote-code", EXIT_OK, r"^══ B5_openthoughts · sample "),
    (f"tokenmill export {B5_URI} --format specforge s3://tokenmill-data/exports/b5/", EXIT_OK,
     r"^dataset +units +written"),
    # docs/running.md's own spec: a user's my-spec.yaml (six prompts of the demo model), first on the built-in
    # simulator, then resumed through two servers and a gateway, and once more into S3 (moto for minio).
    ("tokenmill run my-spec.yaml", EXIT_OK, r"^dataset +slots "),
    ("tokenmill run my-spec.yaml --server http://gpu-host:30000 --server http://gpu-host-2:30000", EXIT_OK,
     r"^dataset +slots "),
    ("tokenmill run my-spec.yaml --out s3://bucket/runs/x/ --s3-endpoint http://minio:9000", EXIT_OK,
     r"^dataset +slots "),
    ("smg launch --worker-urls http://gpu-1:30000 http://gpu-2:30000 --port 30000 --prometheus-port 29000",
     EXIT_OK, r""),
    ("tokenmill run my-spec.yaml --server http://gateway:30000", EXIT_OK, r"^dataset +slots "),
]
# Not run here, and where they are run instead.
ELSEWHERE = {
    "make test": "the suite itself, this test included",
    "make cluster-demo": "tests/e2e/test_cluster_demo.py (the local control plane)",
    "kubectl apply -f b5.yaml": "a cluster: tests/e2e/test_operator.py applies the b5 example; make cluster-demo",
    "kubectl -n tokenmill get dsgen -w": "a cluster: tests/e2e/test_cluster_demo.py watches it go to Succeeded",
    "python hack/make_demo_prompts.py": "tests/unit/test_demo_prompts.py renders it and compares the committed file",
}


def test_every_documented_command_has_a_contract() -> None:
    documented = documented_commands()
    contracted = [command for command, _, _ in RUN] + list(ELSEWHERE)
    assert sorted(documented) == sorted(contracted), (
        f"without a contract: {sorted(set(documented) - set(contracted))}; "
        f"no longer documented: {sorted(set(contracted) - set(documented))}")


def test_the_readme_holds_the_exit_codes_help_prints() -> None:
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", readme, flags=re.M)
    assert [(int(code), meaning.replace("\\|", "|")) for code, meaning in rows] == list(EXIT_CODES)
    helped = tokenmill("--help", cwd=REPO).out
    assert all(re.search(rf"^  {code} +\S", helped, flags=re.M) for code, _ in EXIT_CODES), helped


def test_the_readme_keeps_two_set_up_commands_and_the_demo_installs_the_runtime_only() -> None:
    readme = (REPO / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", readme, flags=re.S)
    assert first and [line.split("#")[0].strip() for line in first.group(1).splitlines()] == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo: install-runtime$", makefile, flags=re.M)
    assert re.search(r"^\$\(RUNTIME\):.*\n\t\$\(VENV\)/bin/pip install --quiet -e '\.\[sim\]'$", makefile, flags=re.M)
    assert re.search(r"^test: install tools$", makefile, flags=re.M)
    assert re.search(r"^\$\(INSTALLED\):.*\n\t\$\(VENV\)/bin/pip install --quiet -e '\.\[test\]'$", makefile,
                     flags=re.M)


# -- the fresh copy and its demo run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository as a clone has it (tracked and not-ignored files), with `make demo` run in it."""
    copy = tmp_path_factory.mktemp("clone") / "tokenmill"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    return copy


@pytest.fixture(scope="module")
def demo(fresh: Path) -> subprocess.CompletedProcess[str]:
    """`make demo` with this environment as its venv: the install is taken as done (-o), the rest runs as written."""
    venv = VENV_BIN.parent
    return subprocess.run(["make", "-o", f"{venv}/.installed-runtime", "-o", f"{venv}/bin/python", "demo",
                           f"VENV={venv}"], cwd=fresh, capture_output=True, text=True, timeout=600)


def test_make_demo_passes_and_sglang_counts_reasoning_as_the_demo_does(fresh, demo, tokenizer) -> None:
    """The demo ends PASS (fails on f9665d2: WARN, 32 generations "disagreeing"), and the count the simulator
    reports as meta_info.reasoning_tokens is the one SGLang 0.5.23 computes: its own update_reasoning_tokens
    (managers/schedule_batch.py:2240-2259, with utils/token_sequence_matcher.py) run token by token on every demo
    output, with the end ids of the kimi_k2 parser (parser/reasoning_parser.py:516-557: think_end_token </think>,
    encoded by the base class, :118; <|tool_calls_section_begin|> ends only its text split, :552). Kimi outputs
    that leave reasoning at the tool-call section are counted whole, and agree."""
    from tokenmill_runner.store.shards import read_committed_rows
    from tokenmill_runner.store.storage import open_storage

    assert demo.returncode == EXIT_OK, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "Report verdict: PASS" in demo.stdout
    count = sglang_reasoning_counter(tokenizer)
    storage = open_storage(str(fresh / "out" / "demo"))
    at_section = 0
    section = tokenizer.convert_tokens_to_ids("<|tool_calls_section_begin|>")
    for dataset in ("B1_glaive", "M1_tool_conversations"):
        for row in read_committed_rows(storage, dataset):
            for turn in row.get("turns") or [row]:
                assert turn["server_reasoning_tokens"] == count(turn["output_ids"]), (dataset, row["sample_id"])
                assert turn["reasoning_agrees"] is True
                at_section += turn["reasoning_end_token_id"] == section
    assert at_section >= 10, "the demo holds outputs that leave reasoning at the tool-call section"
    report = orjson.loads((fresh / "out" / "demo" / "report" / "report.json").read_bytes())
    assert report["verdict"] == "pass" and report["overall"]["reasoning_tokens_disagree"] == 0
    # Readable by the group (a teammate on a shared file system), not 0600.
    assert stat.S_IMODE((fresh / "out" / "demo" / "report" / "report.json").stat().st_mode) & 0o040


def sglang_reasoning_counter(tokenizer):
    """SGLang 0.5.23's reasoning_tokens for the kimi_k2 parser, by the release's own code from its wheel."""
    import ast
    import copy
    from types import SimpleNamespace

    from tests.contract.sglang_wheels import function_node, source, tree

    version = "0.5.23"
    namespace: dict = {}
    exec(compile(source(version, "sglang/srt/utils/token_sequence_matcher.py"), "token_sequence_matcher", "exec"),
         namespace)  # noqa: S102 - the release's own code
    update = copy.deepcopy(function_node(version, "sglang/srt/managers/schedule_batch.py", "update_reasoning_tokens"))
    exec(compile(ast.fix_missing_locations(ast.Module(body=[update], type_ignores=[])), "update_reasoning_tokens",
                 "exec"), namespace)  # noqa: S102
    detector = next(node for node in ast.walk(tree(version, "sglang/srt/parser/reasoning_parser.py"))
                    if isinstance(node, ast.ClassDef) and node.name == "KimiK2Detector")
    assert not any(isinstance(item, ast.FunctionDef) and item.name == "get_think_end_token_ids"
                   for item in detector.body), "the kimi_k2 parser now picks its own end ids"
    init = next(node for node in ast.walk(detector) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__")
    think_end = ast.literal_eval(init.args[1])
    assert think_end == "</think>"
    think_end_ids = tokenizer.encode(think_end, add_special_tokens=False)

    def count(output_ids: list[int]) -> int:
        req = SimpleNamespace(_is_reasoning_over=False, _think_end_matcher=None, _think_end_match_len=0,
                              reasoning_tokens=0)
        for token in output_ids:  # one decode step at a time, as the scheduler calls it
            namespace["update_reasoning_tokens"](req, token, think_end_ids)
        return req.reasoning_tokens

    return count


# -- every documented command ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers(fresh: Path, demo_model: Path, s3_endpoint: str) -> Iterator[dict[str, str]]:
    """What the docs' host names stand for: two demo-model simulators, a Kimi one, moto for S3 and minio, smg."""
    from tests.integration.test_gateway import Gateway
    from tokenmill_runner.store.storage import s3_client
    from tokenmill_sim.config import SimConfig
    from tokenmill_sim.server import SimServer

    s3 = s3_client(s3_endpoint)
    for bucket in ("models", "tokenmill-data", "bucket"):
        s3.create_bucket(Bucket=bucket)
    for path in KIMI.iterdir():
        s3.put_object(Bucket="models", Key=f"moonshotai/Kimi-K2.5/{path.name}", Body=path.read_bytes())
    prompts = (REPO / "examples" / "prompts" / "reasoning.jsonl").read_bytes().splitlines(keepends=True)[:12]
    s3.put_object(Bucket="tokenmill-data", Key="prompts/B5.jsonl", Body=b"".join(prompts))
    with contextlib.ExitStack() as stack:
        demo_sims = [stack.enter_context(SimServer(SimConfig(model_path=str(demo_model), time_scale=5000.0)))
                     for _ in range(2)]
        kimi = stack.enter_context(SimServer(SimConfig(model_path=str(KIMI), trust_remote_code=True,
                                                       time_scale=5000.0)))
        gateway = Gateway([sim.url for sim in demo_sims]).start()
        stack.callback(gateway.stop)
        yield {"http://gpu-host:30000": demo_sims[0].url, "http://gpu-host-2:30000": demo_sims[1].url,
               "http://gpu-1:30000": demo_sims[0].url, "http://gpu-2:30000": demo_sims[1].url,
               "http://minio:9000": s3_endpoint, "http://gateway:30000": gateway.url, "kimi": kimi.url,
               "s3": s3_endpoint, "gateway": gateway}  # type: ignore[dict-item]


def write_user_files(fresh: Path) -> None:
    """b5.yaml is the README's ten lines; my-spec.yaml a user's own small spec, as docs/running.md assumes one."""
    readme = (REPO / "README.md").read_text()
    (fresh / "b5.yaml").write_text(re.search(r"```yaml\n(.*?)```", readme, flags=re.S).group(1))
    rows = (REPO / "examples" / "prompts" / "function_calling.jsonl").read_bytes().splitlines(keepends=True)[:6]
    (fresh / "mine.jsonl").write_bytes(b"".join(rows))
    (fresh / "my-spec.yaml").write_text(yaml.safe_dump({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "mine"},
        "spec": {"model": {"path": "./examples/demo-model"}, "sampling": {"maxNewTokens": 2048},
                 "datasets": [{"name": "mine", "source": "./mine.jsonl"}], "output": {"uri": "./out/mine"}}}))


def test_every_documented_command_runs_as_the_docs_say(fresh, demo, servers, monkeypatch) -> None:
    assert demo.returncode == EXIT_OK, demo.stderr[-3000:]
    write_user_files(fresh)
    failures = []
    for command, code, first in RUN:
        if command == "make demo":
            ran = Ran(demo.returncode, demo.stdout, demo.stderr)
        elif command.startswith("smg launch"):
            servers["gateway"].wait_ready()  # the docs' worker URLs are the two simulators
            ran = Ran(EXIT_OK, "", "")
        else:
            ran = run_documented(command, fresh, servers, monkeypatch)
        if ran.code != code or not re.search(first, ran.first):
            failures.append(f"{command}: exit {ran.code} (want {code}), first line {ran.first!r} (want /{first}/)\n"
                            f"{ran.err[-1500:]}")
    assert not failures, "\n\n".join(failures)
    hf = (fresh / "out" / "demo-hf")
    assert list(hf.glob("data/*.parquet")), "the hf export the README shows writes its data"


def run_documented(command: str, fresh: Path, servers: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Ran:
    args = command.split()[1:]
    args = [servers.get(arg, arg) for arg in args]
    with monkeypatch.context() as env:
        if args[0] == "plan":  # offline: a store that does not answer, given up on at once
            env.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
            env.setenv("TOKENMILL_STORAGE_RETRY_SECONDS", "0")
        else:
            env.setenv("AWS_ENDPOINT_URL_S3", servers["s3"])
        if command == "tokenmill run b5.yaml --server http://gpu-host:30000":
            args = ["run", "b5.yaml", "--server", servers["kimi"]]
        return tokenmill(*args, cwd=fresh)


# -- exit codes a pipeline relies on ---------------------------------------------------------------------------------
def test_report_and_export_exit_codes(fresh, demo, tmp_path) -> None:
    assert demo.returncode == EXIT_OK
    demo_out = fresh / "out" / "demo"
    # A mistyped path: refused, nothing created (fails on f9665d2: FAIL with no reason, exit 0, a new folder).
    typo = tmp_path / "out" / "dmeo"
    refused = tokenmill("report", str(typo), cwd=fresh)
    assert refused.code == EXIT_USAGE and "is not a tokenmill run's output" in refused.err
    assert not typo.exists() and not typo.parent.exists()
    for command in (("inspect", str(typo)), ("export", str(typo), str(tmp_path / "x"), "--format", "hf")):
        assert tokenmill(*command, cwd=fresh).code == EXIT_USAGE
    # PASS passes --fail-on warn; --output json is report.json.
    as_json = tokenmill("report", str(demo_out), "--fail-on", "warn", "--output", "json", cwd=fresh)
    assert as_json.code == EXIT_OK and orjson.loads(as_json.out)["verdict"] == "pass"

    # An unfinished run: the report fails with exit 8, an export says the run is not finished.
    unfinished = tmp_path / "unfinished"
    shutil.copytree(demo_out, unfinished)
    markers = sorted((unfinished / "B5_openthoughts" / "commits").iterdir())
    shutil.rmtree(unfinished / "B5_openthoughts" / "index", ignore_errors=True)
    markers[0].unlink()
    failed = tokenmill("report", str(unfinished), cwd=fresh)
    assert failed.code == EXIT_VERDICT and failed.first == "Report verdict: FAIL", failed.out[:500]
    assert "the run is not finished" in failed.out and "verdict is FAIL" in failed.err
    partial = tokenmill("export", str(unfinished), str(tmp_path / "partial"), "--format", "hf",
                        "--dataset", "B5_openthoughts", cwd=fresh)
    assert partial.code == EXIT_OK and "warning: the run is not finished: B5_openthoughts:" in partial.out

    # An export that writes nothing: exit 5, no `use:` hint (an empty hf folder would load export.json as data).
    empty = tmp_path / "empty"
    nothing = tokenmill("export", str(demo_out), str(empty), "--format", "hf", "--dataset", "B5_openthoughts",
                        "--finish-reason", "length", "--exclude-truncated", cwd=fresh)
    assert nothing.code == EXIT_NO_SAMPLES and "nothing exported" in nothing.err
    assert "use:" not in nothing.out and not list(empty.glob("data/*"))
    exported = tokenmill("export", str(demo_out), str(tmp_path / "json"), "--format", "hf", "--dataset",
                         "B1_glaive", "--output", "json", cwd=fresh)
    assert exported.code == EXIT_OK and orjson.loads(exported.out)["counts"]["written"] == 80


def test_run_refuses_before_anything_starts(fresh, tmp_path) -> None:
    spec = yaml.safe_load((fresh / "examples" / "demo.yaml").read_text())
    out = tmp_path / "never"
    # A server URL without a scheme: refused at once, naming the flag (f9665d2: waited 30 minutes, then exit 1).
    schemeless = tokenmill("run", "examples/demo.yaml", "--server", "localhost:30000", "--out", str(out), cwd=fresh)
    assert schemeless.code == EXIT_USAGE and "argument --server" in schemeless.err
    assert "did you mean http://localhost:30000?" in schemeless.err
    # A source that does not exist: exit 2, the field named, nothing left behind (f9665d2: exit 1 after the
    # simulator started, lease.json and two dataset folders left).
    spec["spec"]["datasets"][2]["source"] = "./prompts/swee.jsonl"
    (fresh / "examples" / "typo.yaml").write_text(yaml.safe_dump(spec))
    missing = tokenmill("run", "examples/typo.yaml", "--out", str(out), cwd=fresh)
    assert missing.code == EXIT_USAGE, missing.err
    assert "spec.datasets[2].source (B8_sweagent)" in missing.err and "swee.jsonl does not exist" in missing.err
    assert not out.exists()
    # One schema with the CRD: a bare number is refused, with the quoted value to write.
    spec["spec"]["datasets"][2]["source"] = "./prompts/swe.jsonl"
    spec["spec"]["sampling"]["temperature"] = 0.6
    (fresh / "examples" / "number.yaml").write_text(yaml.safe_dump(spec))
    number = tokenmill("run", "examples/number.yaml", "--out", str(out), cwd=fresh)
    assert number.code == EXIT_USAGE and 'spec.sampling.temperature: Value error, write the number as a quoted ' \
        'string, "0.6"' in number.err
    assert not out.exists()
    version = tokenmill("--version", cwd=fresh)
    assert version.code == EXIT_OK and re.fullmatch(r"tokenmill \d+\.\d+\.\d+\S*\n", version.out)
