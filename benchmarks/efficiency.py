"""The paper's heterogeneity levels, and a run's efficiency from its events: the definitions
benchmarks/heterogeneity.py (emulated devices) and benchmarks/cgroup.py (CPU quotas) share.

Efficiency of a run = ideal time / actual time, over its training steps:
ideal = sum over BSP steps t of B_t / X_t with X_t = sum_i b_it / c_it, the sum of the
workers' own throughputs at the batches they had in step t (c_it the compute time
worker i reported for step t), i.e. the time the step would take if no worker waited
and there were no communication; actual = summary wall_s.
"""

from collections import defaultdict
from dataclasses import dataclass

LEVELS = {  # relative speeds ("cores") of the 4 workers
    "HL1": (12, 12, 12, 12),
    "HL2": (12, 12, 8, 16),
    "HL4": (9, 9, 6, 24),
    "HL8": (6, 6, 4, 32),
}
SCHEDULE = ("HL1", "HL2", "HL4", "HL8", "HL8", "HL4", "HL2", "HL1")
REFERENCE_SPEED = 12  # speed at which a sample costs C ms (F = 1)


@dataclass(frozen=True)
class Scenario:
    name: str
    slowdowns: tuple[str, ...]  # per worker, a --slowdown value
    capacities: tuple[float, ...]
    budget: tuple[str, ...]  # --epochs N or --max-steps N
    factors: tuple[tuple[float, ...], ...]  # per block (one for a static level), per worker


def factor(speed: float) -> float:
    return REFERENCE_SPEED / speed


def complete_steps(events: list[dict], workers: int) -> dict[int, dict[int, dict]]:
    """The `step` events of each step every one of `workers` reported, by step (in order), then worker."""
    steps = defaultdict(dict)
    for e in events:
        if e["event"] == "step":
            steps[e["step"]][e["worker"]] = e
    return {s: steps[s] for s in sorted(steps) if len(steps[s]) == workers}


def analyse(events: list[dict], summary: dict, scenario: Scenario) -> dict:
    """Efficiency and diagnostics from the step and assign events."""
    n = summary["num_workers"]
    steps = complete_steps(events, n)  # step -> worker -> event
    full = list(steps)
    if len(full) != summary["steps"]:
        raise SystemExit(f"{scenario.name}: {len(full)} complete steps in metrics.jsonl, "
                         f"summary says {summary['steps']}")
    ideal = slowest = 0.0
    per_step = []
    for s in full:
        ws = steps[s]
        b = [ws[i]["batch"] for i in range(n)]
        c = [ws[i]["compute_s"] for i in range(n)]
        x = sum(bi / ci for bi, ci in zip(b, c))
        ideal_t = sum(b) / x
        ideal += ideal_t
        slowest += max(c)
        per_step.append((s, ideal_t, max(c), max(ws[i]["t"] for i in range(n))))
    wall = summary["wall_s"]
    assigns = [e for e in events if e["event"] == "assign"]
    out = {
        "efficiency": ideal / wall,
        "ideal_s": ideal,
        # balance alone: ideal / the slowest worker's compute, summed over steps (no communication)
        "balance": ideal / slowest,
        # what is neither the slowest worker's compute: communication, barrier, evaluations, host noise
        "overhead_ms_per_step": 1000 * (wall - slowest) / len(full),
        "step_ms": 1000 * wall / len(full),
        "assigns": [(e["step"], e["batches"]) for e in assigns],
        "wait_fraction": summary.get("worker_wait_fraction", []),
    }
    ends = {s: t for s, _, _, t in per_step}
    # from step 1 on, between the ends of step 0 and of the last: the job's start (the probe, step 0's
    # first touch of its memory) left out, which a job of a few minutes pays a larger share of
    span = ends[full[-1]] - ends[full[0]]
    out["steps_efficiency"] = sum(r[1] for r in per_step[1:]) / span if span > 0 else float("nan")
    if len(scenario.factors) > 1:  # per block of the schedule
        block = summary["steps"] // len(scenario.factors)
        blocks = []
        for k in range(len(scenario.factors)):
            lo, hi = max(1, k * block), (k + 1) * block - 1  # block 0 from step 1: step 0 has no start time
            rows = [r for r in per_step if lo <= r[0] <= hi]
            if not rows:
                continue
            actual = ends[hi] - ends[lo - 1]
            adj = sum(1 for e in assigns if e["reason"] != "start" and k * block <= e["step"] <= hi)
            blocks.append({"block": k, "level": SCHEDULE[k],
                           "efficiency": sum(r[1] for r in rows) / actual,
                           "balance": sum(r[1] for r in rows) / sum(r[2] for r in rows),
                           "adjustments": adj, "last_batches": [steps[hi][i]["batch"] for i in range(n)]})
        out["blocks"] = blocks
    return out
