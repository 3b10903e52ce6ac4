#!/usr/bin/env python3
"""tokenmill's prefix routing against SGLang's model gateway (smg cache_aware, round_robin), side by side in one
run (issues 26, 44). Not a test.

Each pass starts R fresh simulator replicas (cold radix caches answering meta_info.cached_tokens as SGLang does;
the same seed on every replica, so a sample's output does not depend on where it ran) and runs the real runner
(`prepare` + `Runner`) over one workload, routed one of these ways:
- `tokenmill`: the runner over the R replicas, its own routing (a group's requests together; a new group where its
  prefix was sent);
- `key-only`: the same, but a new group goes to the least-loaded replica (tokenmill's routing before issue 44);
- `smg-cache_aware`, `smg-round_robin`: the runner through `smg launch --policy P` over the R replicas (smg 1.13.0,
  its defaults otherwise).

Workloads:
- `samples`: distinct prompts (nothing shared across them) x `samples: 4`; the ideal cached share is 0.75;
- `conversations`: examples/prompts/conversations.jsonl x 4 copies, a session tag opening each first user message
  (so copies share only the system prompt and the tools), `mode: all-turns`;
- `shared-system`: K long system prompts (few-shot preambles of ~1k tokens) each opening many short, distinct
  prompts, interleaved.
Figures: the share of all prompt tokens sent that the replicas found cached, the share of the history each later
turn re-sends that was cached (conversations), and the makespan (first admission to last completion over every
replica, in simulated seconds, so the machine's speed does not enter).

    .venv/bin/python hack/bench/bench_prefix_routing.py [--replicas 4] [--reps 1] [--workloads samples ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runner import MODEL, REPO  # noqa: E402

sys.path.insert(0, str(REPO / "runner" / "sim"))
sys.path.insert(0, str(REPO))

from tests.integration.test_gateway import Gateway  # noqa: E402 - smg launched as the gateway tests launch it
from tokenmill_runner.generate.routing import PrefixAffinity  # noqa: E402
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
MODES = ("tokenmill", "key-only", "smg-cache_aware", "smg-round_robin")


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


# --- workloads ----------------------------------------------------------------------------------------------------

def write_samples(path: Path, count: int) -> dict[str, Any]:
    """Distinct prompts of a few hundred tokens each, distinct from their first words (no shared system prompt, so
    what is cached is the prompt itself)."""
    with path.open("w") as handle:
        for i in range(count):
            topic = TOPICS[i % len(TOPICS)]
            body = " ".join(f"Point {i}.{k}: how does {topic} relate to the number {i * 31 + k}?" for k in range(24))
            handle.write(json.dumps({"sample_id": f"p{i:05d}", "messages": [
                {"role": "user", "content": f"Case {i} about {topic}. {body} Answer briefly."}]}) + "\n")
    return {"name": "samples", "source": str(path), "samples": 4}


def write_conversations(path: Path, copies: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines() if line.strip()]
    with path.open("w") as handle:
        for copy in range(copies):
            for row in rows:
                messages = [dict(m) for m in row["messages"]]
                first = next(m for m in messages if m["role"] == "user")
                first["content"] = f"[session {copy}-{row['sample_id']}] {first['content']}"
                handle.write(json.dumps({**row, "sample_id": f"{row['sample_id']}-{copy}", "messages": messages}) + "\n")
    return {"name": "conversations", "source": str(path), "mode": "all-turns"}


def write_shared_system(path: Path, preambles: int, per_preamble: int) -> dict[str, Any]:
    """`preambles` few-shot system prompts (~1k tokens each), each opening `per_preamble` short distinct prompts; the
    lines interleave the preambles, as a mixed dataset would."""
    systems = []
    for k in range(preambles):
        topic = TOPICS[k % len(TOPICS)]
        shots = " ".join(f"Example {j}: a question on {topic} number {k}.{j} and its short, careful answer."
                         for j in range(40))
        systems.append(f"You are agent {k}, an expert in {topic}. Follow the style of these examples. {shots}")
    with path.open("w") as handle:
        for i in range(preambles * per_preamble):
            k = i % preambles
            handle.write(json.dumps({"sample_id": f"s{i:05d}", "messages": [
                {"role": "system", "content": systems[k]},
                {"role": "user", "content": f"Question {i}: what is {i} times {k + 3}?"}]}) + "\n")
    return {"name": "shared", "source": str(path)}


# --- one pass -----------------------------------------------------------------------------------------------------

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


def run(spec_path: Path, servers: list[str], by_prefix: bool) -> None:
    spec = load_spec_file(spec_path).spec
    config = RunnerConfig(spec=spec, servers=servers, output_uri=spec.output.uri, progress_log_s=3600)

    async def go() -> None:
        runner = await prepare(config, api_key=None)
        if not by_prefix and runner.client.affinity is not None:
            runner.client.affinity = PrefixAffinity(by_prefix=False)
        summary = await runner.run()
        failed = sum(sum(d.failed.values()) for d in summary.datasets)
        if failed:
            raise SystemExit(f"{failed} samples failed; the passes are not comparable")

    asyncio.run(go())


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def figures(out: Path, dataset: str) -> dict[str, float]:
    cached = sent = history = history_cached = output = 0
    for row in read_committed_rows(LocalStorage(out), dataset):
        cached += row["cached_tokens"]  # a conversation's: its turns' total
        sent += sum(turn["prompt_tokens"] for turn in row["turns"]) if row.get("turns") else row["prompt_tokens"]
        output += row["completion_tokens"]
        for previous, turn in zip(row.get("turns") or [], (row.get("turns") or [])[1:], strict=False):
            held = common_prefix(previous["prompt_ids"] + previous["output_ids"], turn["prompt_ids"])
            history += min(held, len(turn["prompt_ids"]) - 1)
            history_cached += min(turn["cached_tokens"], min(held, len(turn["prompt_ids"]) - 1))
    result = {"share": cached / sent, "prompt_tokens": sent, "output_tokens": output}
    if history:
        result["history"] = history_cached / history
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=64, help="each replica's --max-running-requests")
    parser.add_argument("--concurrency", type=int, default=0, help="the runner's (default: auto, 1.5 x the slots)")
    # Slow enough that the runner keeps up on a small machine, so its own delay does not enter the makespans.
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--prompts", type=int, default=300, help="distinct prompts of the samples workload")
    parser.add_argument("--copies", type=int, default=4, help="copies of the conversations")
    parser.add_argument("--preambles", type=int, default=8)
    parser.add_argument("--per-preamble", type=int, default=60)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--workloads", nargs="+", default=["samples", "conversations", "shared-system"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--json", help="write every pass's figures here")
    args = parser.parse_args(argv)
    concurrency = args.concurrency or int(args.replicas * args.slots * 1.5)
    timeline = Timeline(time_scale=args.time_scale)
    watch(timeline)
    configs = [SimConfig(model_path=str(MODEL), max_running_requests=args.slots, time_scale=args.time_scale,
                         profile="glaive", seed=0) for _ in range(args.replicas)]
    print(f"{args.replicas} simulator replicas x {args.slots} slots, runner concurrency {concurrency}, maxNewTokens "
          f"{args.max_new_tokens}, time scale {args.time_scale:g}; makespan in simulated seconds", flush=True)
    passes: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-prefix-") as tmp:
        datasets = {
            "samples": write_samples(Path(tmp) / "samples.jsonl", args.prompts),
            "conversations": write_conversations(Path(tmp) / "conversations.jsonl", args.copies),
            "shared-system": write_shared_system(Path(tmp) / "shared.jsonl", args.preambles, args.per_preamble),
        }
        for rep in range(args.reps):
            for workload in args.workloads:
                modes = args.modes[rep % len(args.modes):] + args.modes[:rep % len(args.modes)]  # rotated per rep
                for mode in modes:
                    folder = Path(tmp) / f"{workload}-{mode}-{rep}"
                    spec = write_spec(folder, datasets[workload], concurrency, args.max_new_tokens)
                    with ExitStack() as stack:  # fresh replicas per pass: no pass finds another's cache
                        servers = [stack.enter_context(SimServer(config)).url for config in configs]
                        if mode.startswith("smg-"):
                            gateway = Gateway(servers, mode.removeprefix("smg-")).start()
                            stack.callback(gateway.stop)
                            gateway.wait_ready()
                            servers = [gateway.url]
                        timeline.reset()
                        started = time.perf_counter()
                        run(spec, servers, by_prefix=mode != "key-only")
                        wall = time.perf_counter() - started
                    result = {"workload": workload, "mode": mode, "rep": rep, "makespan": timeline.makespan,
                              "wall_s": wall, **figures(folder / "out", datasets[workload]["name"])}
                    passes.append(result)
                    print(f"  {workload:<14} {mode:<16} share {result['share']:.3f}  makespan "
                          f"{result['makespan']:7.1f}  output tokens {result['output_tokens']:,}  "
                          f"({wall:.0f} s wall)", flush=True)
    report(passes, args)
    if args.json:
        Path(args.json).write_text(json.dumps(passes, indent=1))
    return 0


def report(passes: list[dict[str, Any]], args: argparse.Namespace) -> None:
    def spread(values: list[float]) -> str:
        if len(values) == 1:
            return f"{values[0]:.3f}"
        return f"{min(values):.3f}/{statistics.median(values):.3f}/{max(values):.3f}"

    print(f"\ncached share of all prompt tokens (min/median/max over {args.reps} reps); makespan / tokenmill's, paired")
    print(f"{'workload':<15}" + "".join(f"{mode:>20}" for mode in args.modes))
    for workload in args.workloads:
        of = {mode: [p for p in passes if p["workload"] == workload and p["mode"] == mode] for mode in args.modes}
        print(f"{workload:<15}" + "".join(f"{spread([p['share'] for p in of[m]]):>20}" for m in args.modes))
        if any("history" in p for p in passes if p["workload"] == workload):
            print(f"{'  history':<15}" + "".join(f"{spread([p.get('history', 0.0) for p in of[m]]):>20}"
                                                for m in args.modes))
        if "tokenmill" in of:
            base = {p["rep"]: p["makespan"] for p in of["tokenmill"]}
            print(f"{'  makespan x':<15}" + "".join(
                f"{spread([p['makespan'] / base[p['rep']] for p in of[m]]):>20}" for m in args.modes))
    print("goal (issue 44): tokenmill at or above smg cache_aware on every workload, and >= 0.75 on samples")


if __name__ == "__main__":
    raise SystemExit(main())
