"""The measured trial (planner/trial.py) over a grid of hidden truths: the job's ETA without a trial (the plan's
pick runs to the end), with one (trial time, restarts and the slower candidates' minutes included), and on the true
best from the start, side by side. Not a test; prints figures.

    .venv/bin/python hack/bench/bench_trial.py [--noise 0.05]

The plan is the seeds' job as `tokenmill plan` makes it (Kimi-K2.5, 8 x RTX PRO 6000, 8 datasets x 11,000,
maxNewTokens 10,240, node-local weights): its runnable layouts, their predicted ETAs and intervals, and its start-up
model's load as the restart. plan_trial picks the candidates (the pick, then those whose ETA interval overlaps the
best's, within 5 % of the ETA). The truth: each layout's true rate is its predicted rate times a hidden factor. Each
candidate's trial minutes run on the simulator (tokenmill_sim/scrape.py: the capacity model closed-loop with a
concurrency ramp, 128 slots, glaive output lengths, its step time scaled to the true rate, a fresh prompt sample,
the throughput gauge read every 5 s with noise), measured scrape by scrape until the stopping rule stops it; the
remaining work then runs at the chosen layout's true rate. In the simulator the layouts differ only in speed: DP
attention's own mechanics (lockstep groups, eager steps) are not what this measures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runner"))
sys.path.insert(0, str(REPO / "runner" / "sim"))

from tokenmill_operator.decide.planner import model_facts, plan_server  # noqa: E402
from tokenmill_operator.decide.planner.trial import (  # noqa: E402
    Measurement,
    MetricPoint,
    conclude,
    measure,
    options,
    plan_trial,
)
from tokenmill_runner.spec.resource import parse_document  # noqa: E402
from tokenmill_sim.capacity import Job, LinearStepTime, SchedulerParams  # noqa: E402
from tokenmill_sim.profiles import PROFILES  # noqa: E402
from tokenmill_sim.scrape import scrape  # noqa: E402

MODELS = REPO / "tests" / "fixtures" / "models"
CAP = 128
SCRAPE_S = 5.0

DP4, DP2, DP8, TP8 = ("1 x TP 8 + DP attention 4", "1 x TP 8 + DP attention 2", "1 x TP 8 + DP attention 8",
                      "1 x TP 8")
# Hidden truths: each layout's true rate over its predicted one.
GRID: list[tuple[str, dict[str, float]]] = [
    ("plan right", {}),
    ("plan's pick 20 % faster than predicted", {DP4: 1.2}),
    ("all 30 % slower", {DP4: 0.7, DP2: 0.7, DP8: 0.7, TP8: 0.7}),
    ("DP 4 30 % slow (PCIe collectives)", {DP4: 0.7}),
    ("DP 4 50 % slow, DP 2 20 % slow", {DP4: 0.5, DP2: 0.8, DP8: 0.8}),
    ("DP 8 40 % fast, DP 4 20 % slow", {DP4: 0.8, DP8: 1.4}),
    ("DP 2 35 % fast (5 % better than DP 4)", {DP2: 1.35}),
    ("DP 2 28 % fast (within 2 %)", {DP2: 1.28}),
    ("TP 8 best (not among the candidates)", {DP4: 0.6, DP2: 0.8, DP8: 0.8, TP8: 1.3}),
]


def seeds_plan(limit: int):
    data = json.loads((MODELS / "kimi-k2.5.json").read_text())
    spec = parse_document({
        "apiVersion": "tokenmill.io/v1alpha1", "kind": "DatasetGeneration", "metadata": {"name": "trial"},
        "spec": {"model": {"path": "s3://models/kimi-k2.5/", "cache": {"mode": "nodeLocal"}},
                 "server": {"image": "lmsysorg/sglang:v0.5.23", "gpuProduct": "RTX-PRO-6000"},
                 "sampling": {"maxNewTokens": 10240},
                 "datasets": [{"name": f"B{i}", "source": f"s3://p/b{i}.jsonl", "limit": limit} for i in range(1, 9)],
                 "output": {"uri": "s3://out/seeds/"}}}).spec
    return plan_server(spec, model_facts(data["config"], data["weight_bytes"]))


def jobs(seed: int):
    rng = random.Random(seed)
    return iter([Job(rng.randrange(100, 1500), min(10240, PROFILES["glaive"].draw(rng)), 0.0, max_new_tokens=10240)
                 for _ in range(6000)])


def readings(speed: float, seed: int, until: float, noise: float) -> list[MetricPoint]:
    run = scrape(SchedulerParams(max_running_requests=CAP), LinearStepTime(30 / speed, 0.1 / speed), jobs(seed),
                 inflight=CAP + CAP // 2, until=until, interval=SCRAPE_S, ramp_s=60.0, noise=noise, seed=seed)
    return [MetricPoint(r.t, r.gen_throughput, r.running, r.queued) for r in run.readings]


def steady_rate(speed: float) -> float:
    """The simulator's true steady rate at `speed`: a long noise-free run past its warm-up."""
    tail = [p.gen_throughput for p in readings(speed, 999, 1500.0, 0.0) if p.t >= 400]
    return sum(tail) / len(tail)


@dataclass(frozen=True)
class Outcome:
    without: float  # the job's ETA on the plan's pick, seconds
    with_trial: float
    oracle: float  # on the true best from the start
    best: str
    winner: str  # the layout the job continues on
    action: str
    flagged: bool


def scenario(plan, truth: dict[str, float], noise: float, seed: int) -> Outcome:
    opts = {o.name: o for o in options(plan)}
    pick = next(o for o in opts.values() if o.running)
    trial = plan_trial(plan)
    startup = float(plan.startup.seconds if plan.startup else 0)
    restart = trial.restart_s
    base = steady_rate(1.0)  # the simulator's rate of the pick as predicted
    pred_gen = pick.eta_s - startup
    tokens = base * pred_gen  # the job, in the simulator's tokens: the pick as predicted takes the plan's time

    def speed(name: str) -> float:
        return pick.eta_s / opts[name].eta_s * truth.get(name, 1.0)  # ETA ratio ~ predicted rate ratio

    rate = {name: base * speed(name) for name in opts}
    without = startup + tokens / rate[pick.name]
    best = max(opts, key=lambda n: rate[n])
    oracle = startup + tokens / rate[best]
    if not trial.worthwhile:
        return Outcome(without, without, oracle, best, pick.name, "no trial", False)
    clock, done = startup, 0.0
    measured: list[Measurement] = []
    for i, name in enumerate(trial.candidates):
        if i:
            clock += restart
        points = readings(speed(name), seed + 17 * i, trial.measure_s + SCRAPE_S, noise)
        m, _ = measure(name, points, trial.measure_s, measured, cap=CAP)
        measured.append(m)
        clock += m.elapsed_s + SCRAPE_S
        done += sum(p.gen_throughput * SCRAPE_S for p in points if p.t <= m.elapsed_s + SCRAPE_S)
    running = trial.candidates[-1]
    result = conclude(measured, running, tokens - done, restart)
    final = result.continue_on
    if final != running:
        clock += restart
    with_trial = clock + (tokens - done) / rate[final]
    action = result.decision.action if result.decision is not None else "stay (the winner runs)"
    if final != running:
        action = f"switch {short(running)} -> {short(final)}"
    elif result.decision is not None:
        action = f"stay on {short(running)}"
    return Outcome(without, with_trial, oracle, best, final, action, result.flagged)


def short(name: str) -> str:
    return name.replace("1 x TP 8 + DP attention ", "DP ").replace("1 x TP 8", "TP 8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--noise", type=float, default=0.05, help="relative noise on the throughput gauge")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    plan = seeds_plan(11_000)
    trial = plan_trial(plan)
    layouts = [f"{short(o.name)} {o.eta_s / 3600:.1f} h [{o.eta_low_s / 3600:.1f}, {o.eta_high_s / 3600:.1f}]"
               for o in options(plan)]
    print("the seeds' job, predicted ETA [interval]: " + "; ".join(layouts))
    print(f"trial: {' -> '.join(short(c) for c in trial.candidates)}; restart {trial.restart_s:,.0f} s; "
          f"{trial.reason}")
    print(f"{'hidden truth':<40} {'true best':>9} {'continued on':>13} {'':>6} {'decision':<24} "
          f"{'no trial':>9} {'trial':>8} {'best':>8} {'gain':>7}")
    for label, truth in GRID:
        r = scenario(plan, truth, args.noise, args.seed)
        gain = r.without - r.with_trial
        print(f"{label:<40} {short(r.best):>9} {short(r.winner):>13} {'flag' if r.flagged else '':>6} "
              f"{r.action:<24} {r.without / 3600:>8.2f}h {r.with_trial / 3600:>7.2f}h {r.oracle / 3600:>7.2f}h "
              f"{gain / 3600:>+6.2f}h")
    small = seeds_plan(300)
    t = plan_trial(small)
    p = next(o for o in options(small) if o.running)
    print(f"a short job (8 x 300): ETA {p.eta_s / 3600:.2f} h -> trial {'none' if not t.worthwhile else t.candidates}: "
          f"{t.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
