#!/usr/bin/env python
"""The dynamic-batching controller replayed on recorded noise: real machines' step times,
seconds to run.

`benchmarks/cgroup.py` measures the controller on real compute under CPU quotas, a
run of its table takes about 40 minutes, and one run of a case lies anywhere in a few %
of the next. Here the scheduler's own controller object (scheduler/control.BatchControl)
is driven, closed-loop, by step times recorded in that benchmark's runs at fixed plans
(benchmarks/traces/quota.json, made by `--record` from `--keep-runs` directories): each
worker's time per sample at each step, times the batch the controller gives it. A step
lasts as long as its slowest worker; a new plan is used from the step after next, as in a
live run. The start plan comes from probe passes (their times, spread and CPU quota)
recorded in the controller's runs of the same case (each probe set in turn), and, as a
baseline for what the probe costs, from "exact" passes: each worker's own second step,
scaled to the probe's sizes.

Per case, and per recorded plan (uniform batches, or the static plan the quotas call for),
the table gives the replayed job's time over the time the recorded plan took on the same
steps: the mean, the worst and the share of replays above 1.02 (the bound on the dynamic
job's time over uniform batches'), and how much of the mean lies in the first 20 steps
(their excess over the recorded plan's, relative to the recorded job's time): the probe's
plan and the first windows. Then the ceiling the steps' own noise sets: the replayed job's
efficiency (compute only: each step's global batch at the sum of the workers' throughputs
at that step, over the step's replayed time), beside that of the best fixed plan in
hindsight (the plan, chosen knowing every step, whose steps took the least time in all).
A step's time is its slowest worker's, and noise moves that from step to step, which no
plan made before the step can follow: what the controller leaves below that plan is its
own doing, what that plan leaves below 1 the host's.

What it leaves out: a step's time is taken to be proportional to the batch (under a
quota it jumps where the quota runs out), and the first step at a new batch size costs
nothing extra.

    python benchmarks/replay.py [--traces benchmarks/traces/quota.json] [--out benchmarks/results/replay.md]
    python benchmarks/replay.py --record DIR... [--traces FILE]   # recorded runs into a traces file
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish  # noqa: E402
from simulation import oracle_plan  # noqa: E402

from omnips.batching import PROBE_BATCHES, BatchPlan, initial_batches  # noqa: E402
from omnips.job import JobSpec  # noqa: E402
from omnips.scheduler.control import BatchControl  # noqa: E402

EARLY = 20  # steps of the start: the probe's plan and the first windows
OVER = 1.02  # the bound the dynamic job's time is held to over uniform batches'


def record(dirs: list[Path]) -> dict:
    """Traces from benchmarks/cgroup.py's kept run directories: the per-sample times of its runs
    at fixed plans (uniform, static) and the probe passes of its controller's runs, by case."""
    cases: dict[str, dict] = {}
    for run in sorted(d for root in dirs for d in root.iterdir() if (d / "metrics.jsonl").exists()):
        case, arm, _ = run.name.rsplit("-", 2)
        if arm == "alone":  # (CASE-affine-alone-N: the dynamic job run again by itself)
            continue
        steps, probes = {}, {}
        for line in (run / "metrics.jsonl").read_text().splitlines():
            e = json.loads(line)
            if e["event"] == "step":
                steps.setdefault(e["step"], {})[e["worker"]] = (e["batch"], e["compute_s"])
            elif e["event"] == "probe":
                probes[e["worker"]] = [e["batches"], [round(s, 6) for s in e["seconds"]], round(e.get("spread", 0.0), 4),
                                       e.get("quota", 0.0)]
        entry = cases.setdefault(case, {"runs": [], "probes": []})
        n = max(map(len, steps.values()), default=0)
        if arm == "affine" and len(probes) == n > 0:
            entry["probes"].append([probes[w] for w in range(n)])
        elif arm in ("uniform", "static") and n:
            full = [steps[s] for s in sorted(steps) if len(steps[s]) == n]
            entry["runs"].append({"arm": arm, "plan": [full[0][w][0] for w in range(n)],
                                  "ms_per_sample": [[round(1000 * s[w][1] / s[w][0], 2) for w in range(n)]
                                                    for s in full]})
    return cases


def ideal_s(per_sample: np.ndarray, total: int) -> float:
    """The job's time with every step's `total` samples at the sum of the workers' throughputs then."""
    return float((total / (1.0 / per_sample).sum(axis=1)).sum())


def best_fixed(per_sample: np.ndarray, total: int, reach: int = 2) -> tuple[tuple[int, ...], float]:
    """The fixed plan of `total` samples (at least one each) whose steps take the least time in all,
    and that time: from the equal-time plan on the mean times per sample (simulation.oracle_plan),
    the best of the plans within `reach` samples of it a worker, again from that one until none
    is better. (Moving one sample at a time stopped short of the best on a recorded one-sided
    load; tests/test_replay.py checks the search against every plan of small jobs.)"""
    steps, n = per_sample.shape
    plan = oracle_plan(np.column_stack([np.zeros(n), per_sample.mean(axis=0)]), total).astype(np.int64)
    offsets = np.array([d for d in itertools.product(range(-reach, reach + 1), repeat=n) if sum(d) == 0])
    while True:
        plans = plan + offsets
        plans = plans[(plans >= 1).all(axis=1)]
        took = (per_sample[None] * plans[:, None, :]).max(axis=2).sum(axis=1)
        best = plans[np.argmin(took)]
        if (best == plan).all():
            return tuple(int(b) for b in plan), float(took.min())
        plan = best


def replay(per_sample: np.ndarray, plan: list[int], probe: list) -> tuple[float, float, float]:
    """The replayed job's time over the recorded plan's, its excess over the recorded plan's in the
    first EARLY steps, relative to the recorded job's time, and its efficiency (compute only)."""
    steps, n = per_sample.shape
    total = int(sum(plan))
    job = JobSpec(num_workers=n, global_batch=total, batching="dynamic", adjust_every=10, max_steps=steps)
    control = BatchControl(job, BatchPlan(0, tuple(initial_batches("uniform", total, [1.0] * n, 1, total))))
    control.probed({rank: (sizes, seconds) for rank, (sizes, seconds, _, _) in enumerate(probe)}, {},
                   {rank: p[2] for rank, p in enumerate(probe)}, {rank: p[3] for rank, p in enumerate(probe)})
    used, pending = np.asarray(control.plan.batches, dtype=np.float64), []
    recorded = (per_sample * np.asarray(plan)).max(axis=1)
    took = np.zeros(steps)
    for step in range(steps):
        times = per_sample[step] * used
        took[step] = times.max()
        for rank in range(n):
            control.on_step(rank, int(used[rank]), float(times[rank]))
        if control.ready:
            control.replan()
        pending.append(np.asarray(control.plan.batches, dtype=np.float64))
        if len(pending) > 1:  # server 0 hands a plan on at the step after next
            used = pending.pop(0)
    return (took.sum() / recorded.sum(), (took[:EARLY].sum() - recorded[:EARLY].sum()) / recorded.sum(),
            ideal_s(per_sample, total) / took.sum())


def exact_probe(per_sample: np.ndarray) -> list:
    """Passes timed as the run's second step ran, each worker's time per sample at it (no spread, no quota)."""
    return [[list(PROBE_BATCHES), [float(per_sample[1, w]) * size for size in PROBE_BATCHES], 0.0, 0.0]
            for w in range(per_sample.shape[1])]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=HERE / "traces" / "quota.json")
    p.add_argument("--record", type=Path, nargs="+", help="benchmarks/cgroup.py --keep-runs directories to record")
    p.add_argument("--limit", type=int, default=0, help="at most this many runs a case (0: all)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "replay.md")
    args = p.parse_args(argv)
    if args.record:
        traces = record(args.record)
        args.traces.parent.mkdir(parents=True, exist_ok=True)
        args.traces.write_text(json.dumps(traces, separators=(",", ":")) + "\n")
        print(f"{args.traces}: " + ", ".join(f"{case} {len(t['runs'])} runs, {len(t['probes'])} probes"
                                             for case, t in sorted(traces.items())))
        return 0
    traces = json.loads(args.traces.read_text())
    lines = ["# The controller replayed on recorded step times", "",
             f"Produced by `benchmarks/replay.py --traces {args.traces.name}"
             + (f" --limit {args.limit}" if args.limit else "") + "`; see its docstring.", "",
             *machine_lines(), "",
             "| case | recorded plan | probe | replays | job time / recorded plan's, mean | worst | share above "
             f"{OVER} | of the mean, in the first {EARLY} steps | efficiency, mean | best fixed plan's efficiency |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for case, t in sorted(traces.items()):
        for arm in sorted({run["arm"] for run in t["runs"]}):
            runs = [run for run in t["runs"] if run["arm"] == arm][:args.limit or None]
            for kind in ("recorded", "exact") if t["probes"] else ("exact",):
                out, ceiling = [], []
                for run in runs:
                    per_sample = np.asarray(run["ms_per_sample"]) / 1000
                    total = sum(run["plan"])
                    ceiling.append(ideal_s(per_sample, total) / best_fixed(per_sample, total)[1])
                    for probe in t["probes"] if kind == "recorded" else [exact_probe(per_sample)]:
                        out.append(replay(per_sample, run["plan"], probe))
                out = np.array(out)
                ratios = out[:, 0]
                lines.append(f"| {case} | {arm} | {kind} | {len(out)} | {ratios.mean():.4f} | {ratios.max():.4f} | "
                             f"{np.mean(ratios > OVER):.2f} | {out[:, 1].mean():+.4f} | {out[:, 2].mean():.4f} "
                             f"| {np.mean(ceiling):.4f} |")
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
