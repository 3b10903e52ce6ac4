#!/usr/bin/env python3
"""A chat rendered by transformers' apply_chat_template(tokenize=False) against the runner's ChatRenderer
(render/chat_render.py), side by side on the same chats. Not a test (tests/unit/test_chat_render.py holds the two to
the same text).

For each tokenizer (the demo model and the fixture families that load without remote code) and each fixture
prompt, both render it `--reps` times in alternating rounds; reported: microseconds per render, each way, and the
ratio, median over the prompts.

    .venv/bin/python hack/bench/bench_chat_render.py [--reps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

from tokenmill_runner.render.content_format import flatten
from tokenmill_runner.render.pretokenize import PromptEncoder, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "tokenizers"
MODELS = [REPO / "examples" / "demo-model"] + [FIXTURES / name for name in
                                                ("qwen3", "llama-3.1", "deepseek-r1", "gpt-oss", "qwen3-coder",
                                                 "glm-4.5", "deepseek-v3.1")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=300)
    args = parser.parse_args()
    rows = [json.loads(line) for line in (FIXTURES / "prompts.jsonl").read_text().splitlines() if line.strip()]
    print(f"us per render, median over the fixture prompts that render ({args.reps} reps each way)")
    for path in MODELS:
        tokenizer = load_tokenizer(str(path), False)
        encoder = PromptEncoder(tokenizer)
        times: dict[str, list[float]] = {"apply_chat_template": [], "ChatRenderer": []}
        for row in rows:
            messages, tools = flatten(row["messages"], encoder.content_format), row.get("tools")
            ways = {"apply_chat_template": partial(tokenizer.apply_chat_template, messages, tools=tools,
                                                   add_generation_prompt=True, tokenize=False),
                    "ChatRenderer": partial(encoder.renderer.render, messages, tools, {})}
            try:
                texts = {name: way() for name, way in ways.items()}
            except Exception:  # noqa: BLE001 - a prompt this template refuses (both refuse it: the test checks)
                continue
            assert texts["apply_chat_template"] == texts["ChatRenderer"], (path.name, row["sample_id"])
            for rep in range(2):
                for name in (list(ways) if rep == 0 else list(reversed(ways))):
                    started = time.process_time()
                    for _ in range(args.reps // 2):
                        ways[name]()
                    times[name].append((time.process_time() - started) / (args.reps // 2) * 1e6)
        slow, fast = (statistics.median(times[name]) for name in times)
        print(f"  {path.name:14} apply_chat_template {slow:7.1f}  ChatRenderer {fast:7.1f}  x{fast / slow:.2f}")


if __name__ == "__main__":
    main()
