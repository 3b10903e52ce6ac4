#!/usr/bin/env python3
"""Prefix-affine routing against least-loaded routing (issue 26): 4 simulator replicas (in this process, each with
its own radix cache answering meta_info.cached_tokens as SGLang's does), the real runner (`prepare` + `Runner`), the
same workload twice, side by side. Not a test.

Two workloads:
- `samples: 4` of distinct prompts: the share of all prompt tokens sent that SGLang found cached. The ideal is 0.75
  (the first sample of each prompt prefills it, the three others find all but its last token); least-loaded
  routing sends the samples of a prompt to different replicas, so about 1/R of them find it.
- `mode: all-turns` conversations (examples/prompts/conversations.jsonl): of the history each turn re-sends (its
  prompt's common prefix with the previous turn's prompt and output, the most any cache can hold), the share cached.
Makespan: first admission to last completion over all replicas, in simulated seconds (each replica's clock mapped
to one time line), so the machine's speed does not enter.

    .venv/bin/python hack/bench/bench_prefix_routing.py [--prompts 300] [--replicas 4] [--concurrency 128]

Measured (2 shared CPU cores, defaults): cached share 0.30-0.31 least-loaded, 0.751 prefix-affine (five runs);
all-turns history cached 0.87-0.93 / 1.000 (the demo's conversations share their system prompt and tools, so
least-loaded hits often too); samples: 4 makespan x1.025, x0.991, x0.981, x1.025, x0.961 of least-loaded (mean
x0.997; least-loaded alone varies by 2 % between runs), all-turns x0.51 and x0.75 (long histories are no longer
prefilled on every turn). `--spill-rel 1.1 --spill-abs 4` (a tighter gate than smg's): x0.991, share 0.751.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MODEL, REPO  # noqa: E402

sys.path.insert(0, str(REPO / "runner" / "sim"))

from tokenmill_runner.generate.routing import SPILL_ABS_THRESHOLD, SPILL_REL_THRESHOLD, PrefixAffinity, SpillGate  # noqa: E402,E501
from tokenmill_runner.prepare import prepare  # noqa: E402
from tokenmill_runner.spec.config import RunnerConfig  # noqa: E402
from tokenmill_runner.spec.resource import load_spec_file  # noqa: E402
from tokenmill_runner.store.shards import read_committed_rows  # noqa: E402
from tokenmill_runner.store.storage import LocalStorage  # noqa: E402
from tokenmill_sim import capacity, engine  # noqa: E402
from tokenmill_sim.config import SimConfig  # noqa: E402
from tokenmill_sim.server import SimServer  # noqa: E402

CONVERSATIONS = REPO / "examples" / "prompts" / "conversations.jsonl"
TOPICS = ("orbital mechanics", "sourdough", "tax law", "graph theory", "jazz harmony", "glaciers", "compilers",
          "beekeeping", "typography", "volcanoes")


@dataclass
class Timeline:
    """First admission and last completion over every replica, on the wall clock (perf_counter seconds)."""

    first: float = math.inf
    last: float = -math.inf
    time_scale: float = 1.0

    def reset(self) -> None:
        self.first, self.last = math.inf, -math.inf

    @property
    def makespan(self) -> float:
        """Simulated seconds."""
        return (self.last - self.first) * self.time_scale


def watch(timeline: Timeline) -> None:
    """Each engine's finished jobs, their simulated times mapped through that engine's clock to the wall clock."""
    init = engine.Engine.__init__

    def recording_init(self: engine.Engine, model: capacity.CapacityModel, clock: engine.SimClock,
                       *args: Any, **kwargs: Any) -> None:
        init(self, model, clock, *args, **kwargs)
        advance = model.advance_to
        origin = clock._origin  # noqa: SLF001 - the wall-clock instant of simulated time 0

        def recording(now: float) -> list[capacity.Job]:
            done = advance(now)
            for job in done:
                if job.prompt_ids is None:
                    continue  # /health's one-token request
                if job.admitted_at is not None:
                    timeline.first = min(timeline.first, origin + job.admitted_at / clock.time_scale)
                if job.finished_at is not None:
                    timeline.last = max(timeline.last, origin + job.finished_at / clock.time_scale)
            return done

        model.advance_to = recording  # type: ignore[method-assign]

    engine.Engine.__init__ = recording_init  # type: ignore[method-assign]


def write_spec(folder: Path, dataset: dict[str, Any], concurrency: int, max_new_tokens: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "prefix"},
            "spec": {"model": {"path": str(MODEL)}, "sampling": {"maxNewTokens": max_new_tokens},
                     "datasets": [dataset],
                     "runner": {"concurrency": concurrency, "shardMaxSamples": 256, "shardMaxSeconds": 30},
                     "output": {"uri": str(folder / "out")}}}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def write_prompts(path: Path, count: int) -> Path:
    """Distinct prompts of a few hundred tokens each, distinct from their first words (no shared system prompt, so
    what is cached is the prompt itself)."""
    with path.open("w") as handle:
        for i in range(count):
            topic = TOPICS[i % len(TOPICS)]
            body = " ".join(f"Point {i}.{k}: how does {topic} relate to the number {i * 31 + k}?" for k in range(24))
            handle.write(json.dumps({"sample_id": f"p{i:05d}", "messages": [
                {"role": "user", "content": f"Case {i} about {topic}. {body} Answer briefly."}]}) + "\n")
    return path


def run(spec_path: Path, servers: list[str], affine: bool, gate: SpillGate | None = None) -> None:
    spec = load_spec_file(spec_path).spec
    config = RunnerConfig(spec=spec, servers=servers, output_uri=spec.output.uri, progress_log_s=3600)

    async def go() -> None:
        runner = await prepare(config, api_key=None)
        if not affine:
            runner.client.affinity = None  # every request to the least-loaded live replica, as before issue 26
        elif gate is not None:
            runner.client.affinity = PrefixAffinity(gate)
        summary = await runner.run()
        failed = sum(sum(d.failed.values()) for d in summary.datasets)
        if failed:
            raise SystemExit(f"{failed} samples failed; the passes are not comparable")

    asyncio.run(go())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def sample_share(out: Path, dataset: str) -> float:
    rows = list(read_committed_rows(LocalStorage(out), dataset))
    return sum(r["cached_tokens"] for r in rows) / sum(r["prompt_tokens"] for r in rows)


def history_share(out: Path, dataset: str) -> tuple[float, int]:
    cached = history = turns = 0
    for row in read_committed_rows(LocalStorage(out), dataset):
        for previous, turn in zip(row["turns"], row["turns"][1:], strict=False):
            held = common_prefix(previous["prompt_ids"] + previous["output_ids"], turn["prompt_ids"])
            history += min(held, len(turn["prompt_ids"]) - 1)
            cached += turn["cached_tokens"]
            turns += 1
    return cached / history, turns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=300, help="distinct prompts of the samples: 4 workload")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=128, help="the runner's, over all replicas")
    parser.add_argument("--slots", type=int, default=64, help="each replica's --max-running-requests")
    # Slow enough that the runner keeps up on a small machine: at 20x it fell behind, and its own delay entered the
    # makespans (x1.27 one run, x0.63 the next).
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--only-samples", action="store_true", help="run the samples: 4 workload alone")
    parser.add_argument("--spill-abs", type=int, default=SPILL_ABS_THRESHOLD, help="the spill gate's absolute part")
    parser.add_argument("--spill-rel", type=float, default=SPILL_REL_THRESHOLD, help="the spill gate's relative part")
    args = parser.parse_args(argv)
    gate = SpillGate(args.spill_abs, args.spill_rel)
    timeline = Timeline(time_scale=args.time_scale)
    watch(timeline)
    configs = [SimConfig(model_path=str(MODEL), max_running_requests=args.slots, time_scale=args.time_scale,
                         profile="glaive", seed=i) for i in range(args.replicas)]
    print(f"{args.replicas} simulator replicas x {args.slots} slots, runner concurrency {args.concurrency}, "
          f"maxNewTokens {args.max_new_tokens}; makespan in simulated seconds")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenmill-prefix-") as tmp:
        source = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        workloads = {
            "samples": {"name": "samples", "source": str(source), "samples": 4},
            "all-turns": {"name": "conv", "source": str(CONVERSATIONS), "mode": "all-turns"},
        }
        if args.only_samples:
            del workloads["all-turns"]
        for workload, dataset in workloads.items():
            for routing in ("least-loaded", "prefix-affine"):
                folder = Path(tmp) / f"{workload}-{routing}"
                spec = write_spec(folder, dataset, args.concurrency, args.max_new_tokens)
                # Fresh replicas per pass: a cache warmed by the other routing's pass would flatter the second.
                with ExitStack() as replicas:
                    servers = [replicas.enter_context(SimServer(config)).url for config in configs]
                    timeline.reset()
                    run(spec, servers, affine=routing == "prefix-affine", gate=gate)
                figures = {"makespan": timeline.makespan}
                if workload == "samples":
                    figures["share"] = sample_share(folder / "out", dataset["name"])
                else:
                    figures["share"], figures["turns"] = history_share(folder / "out", dataset["name"])
                results[f"{workload}/{routing}"] = figures
    print(f"{'':>28}{'least-loaded':>14}{'prefix-affine':>15}   goal")
    s_ll, s_pa = results["samples/least-loaded"], results["samples/prefix-affine"]
    print(f"{'samples: 4, cached share':>28}{s_ll['share']:>14.3f}{s_pa['share']:>15.3f}   >= 0.70 (ideal 0.75)")
    pairs = [("samples: 4", s_ll, s_pa)]
    if "all-turns/least-loaded" in results:
        c_ll, c_pa = results["all-turns/least-loaded"], results["all-turns/prefix-affine"]
        print(f"{'all-turns, history cached':>28}{c_ll['share']:>14.3f}{c_pa['share']:>15.3f}   >= 0.90 "
              f"({int(c_pa['turns'])} later turns)")
        pairs.append(("all-turns", c_ll, c_pa))
    for name, ll, pa in pairs:
        ratio = pa["makespan"] / ll["makespan"]
        print(f"{name + ', makespan (s)':>28}{ll['makespan']:>14,.1f}{pa['makespan']:>15,.1f}   "
              f"x{ratio:.3f} of least-loaded (goal <= x1.02)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
