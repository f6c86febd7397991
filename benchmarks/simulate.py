#!/usr/bin/env python
"""The dynamic-batching controller at scale, with modelled workers instead of processes.

Drives the scheduler's own controller object (scheduler/control.BatchControl, and
through it omnips/batching.py) with N workers whose compute phase takes
F_i * (a_i + c_i * b) seconds times a noise factor, BSP: a step lasts as long as its
slowest worker plus a fixed communication time. Speeds F_i are drawn from the
paper's heterogeneity range (up to 8x apart); at mid-run a quarter of the workers
become 3x slower. A new plan is used from the step after next, as server 0 hands it
on in a live run. Reported per N:

* efficiency: ideal / actual time over the steps after the first convergence
  (ideal = what the steps would take if every worker ran at its own throughput with
  nobody waiting, plus the communication time);
* adjustments to converge at the start and after the speed change: plan changes
  until the step time is within 5 % of the equal-time plan's;
* the controller's CPU time per decision (one `replan`), median and max.

    python benchmarks/simulate.py [--workers 4,64,1024,4096] [--noise 0.05] [--steps 240]

Prints a table and writes it to benchmarks/results/simulate.md.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish  # noqa: E402

from omnips.batching import BatchPlan, equal_time, initial_batches  # noqa: E402
from omnips.job import JobSpec  # noqa: E402
from scheduler.control import BatchControl  # noqa: E402

COMM_S = 0.005
SAMPLES_PER_WORKER = 32


def simulate(n: int, steps: int, noise: float, adjust_every: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    total = SAMPLES_PER_WORKER * n
    a = rng.uniform(0.002, 0.010, n)  # fixed cost per step, s
    c = rng.uniform(0.0005, 0.002, n)  # per sample at speed 1, s
    speed = rng.uniform(1.0, 8.0, n)
    job = JobSpec(num_workers=n, global_batch=total, batching="dynamic", adjust_every=adjust_every,
                  max_steps=steps)
    plan = BatchPlan(0, tuple(initial_batches("uniform", total, [1.0] * n, 1, total)))
    control = BatchControl(job, plan)
    change_at = steps // 2
    slowed = rng.choice(n, n // 4, replace=False)
    pending: list[tuple[int, BatchPlan]] = []
    decisions_s, changes_at = [], []
    step_times, best_times, ideal_times = [], [], []
    for step in range(steps):
        while pending and pending[0][0] <= step:
            plan = pending.pop(0)[1]  # the workers switch; the controller has had it since it decided
        f = 1.0 / speed
        if step >= change_at:
            f = f.copy()
            f[slowed] *= 3.0
        b = np.asarray(plan.batches, dtype=np.float64)
        t = f * (a + c * b) * (1.0 + rng.uniform(-noise, noise, n))
        ideal_times.append(total / np.sum(b / t))  # every worker at its own throughput, nobody waiting
        step_times.append(t.max())
        best = f * a, f * c
        best_times.append(float(np.max(best[0] + best[1] * equal_time(list(zip(*best)), total, 1, total))))
        for rank in range(n):
            control.on_step(rank, plan.batches[rank], float(t[rank]))
        if control.ready:
            before = control.plan
            start = time.process_time()
            control.replan()
            decisions_s.append(time.process_time() - start)
            if control.plan != before:
                pending.append((step + 2, control.plan))
                changes_at.append(step)
    return {"n": n, "steps": steps, "step_times": step_times, "best": best_times, "ideal": ideal_times,
            "changes": changes_at, "decisions_s": decisions_s, "change_at": change_at}


def converged_after(r: dict, start: int, end: int) -> tuple[int | None, int]:
    """(adjustments made from `start` until the step time is within 5 % of the best, or
    None if never before `end`; the step where that happened)."""
    for s in range(start, end):
        if r["step_times"][s] <= 1.05 * r["best"][s]:
            return sum(1 for c in r["changes"] if start <= c < s), s
    return None, end


def summarise(r: dict) -> dict:
    first, settled = converged_after(r, 0, r["change_at"])
    second, _ = converged_after(r, r["change_at"], r["steps"])
    steady = range(settled, r["steps"])
    eff = sum(r["ideal"][s] + COMM_S for s in steady) / sum(r["step_times"][s] + COMM_S for s in steady)
    d = r["decisions_s"]
    return {"n": r["n"], "efficiency": eff, "first": first, "after_change": second,
            "decision_ms": 1000 * statistics.median(d) if d else 0.0, "decision_max_ms": 1000 * max(d) if d else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="4,64,1024,4096")
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--adjust-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "simulate.md")
    args = p.parse_args(argv)
    start = time.monotonic()
    rows = []
    for n in [int(v) for v in args.workers.split(",")]:
        s = summarise(simulate(n, args.steps, args.noise, args.adjust_every, args.seed))
        print(f"{n} workers: efficiency {s['efficiency']:.3f}, converged in {s['first']} / {s['after_change']} "
              f"adjustments, decision {s['decision_ms']:.2f} ms (max {s['decision_max_ms']:.2f})", flush=True)
        rows.append(s)
    lines = [
        "# The controller simulated at scale (BSP, modelled workers)", "",
        *machine_lines(),
        f"- command: `python benchmarks/simulate.py {' '.join(sys.argv[1:])}` ({time.monotonic() - start:.0f} s)",
        f"- workers: compute F*(a + c*b) s, a in 2..10 ms, c in 0.5..2 ms, speeds 1..8 (F = 1/speed), "
        f"±{args.noise:.0%} noise per step; {SAMPLES_PER_WORKER} samples per worker in the global batch; "
        f"{1000 * COMM_S:g} ms of communication per step; a quarter of the workers 3x slower from step "
        f"{args.steps // 2}; --adjust-every {args.adjust_every}", "",
        "| workers | efficiency after the first convergence | adjustments to converge: start / after the change "
        "| decision CPU ms, median (max) |",
        "|---:|---:|---|---:|",
    ]
    for s in rows:
        lines.append(f"| {s['n']} | {s['efficiency']:.3f} | {s['first']} / {s['after_change']} | "
                     f"{s['decision_ms']:.2f} ({s['decision_max_ms']:.2f}) |")
    lines += ["", "Converged: the step time (slowest worker) within 5 % of the equal-time plan's; None: not "
              "within the phase. Efficiency: ideal over actual time of the steps after the first convergence (the "
              "speed change included), ideal being what a step would take with every worker at its own "
              "throughput that step (noise included) and nobody waiting; communication counted in both. With "
              "independent noise the slowest of N workers is always near +noise: that, not the plan, is what "
              "a BSP step waits for at large N."]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
