#!/usr/bin/env python
"""Dynamic batching on emulated heterogeneous clusters: uniform vs static vs the controller.

One invocation trains, for each scenario below, BSP on digits (mlp, 4 workers, one
server, --global-batch 128, --lr 0.05, --seed 0, one torch thread per worker) with the
batching variants

* uniform: equal batches;
* static: batches in proportion to the declared --capacity (the worker's relative speed);
* proportional: --batching dynamic --controller proportional (the paper's rule);
* affine: --batching dynamic --controller affine (fits t = a + c*b per worker).

Scenarios follow the paper's heterogeneity levels, "cores" taken as relative speeds:
HL1 12/12/12/12, HL2 12/12/8/16, HL4 9/9/6/24, HL8 6/6/4/32 (a fixed --epochs budget),
and the dynamic schedule HL1 -> HL2 -> HL4 -> HL8 -> HL8 -> HL4 -> HL2 -> HL1 in equal
blocks of steps (a fixed --max-steps budget).

Every worker runs the same virtual device, --emulate-ms-per-step A and
--emulate-ms-per-sample C (a step's compute phase lasts F * (A + C*b) ms), with the
slowdown F = 12 / speed: from step 0 for a static level, as a --slowdown schedule
STEP:F,... for the dynamic one. Declared capacities: the worker's speed at a static
level (for static, and as the start of the dynamic variants: the paper's static start
by core count; --dynamic-start uniform starts them from equal batches instead); for the
schedule, the HL1 capacities (equal), what a user would declare up front.

Efficiency of a run = ideal time / actual time, over its training steps:
ideal = sum over BSP steps t of B_t / X_t with X_t = sum_i b_it / c_it, the sum of the
workers' own throughputs at the batches they had in step t (c_it the compute time
worker i reported for step t), i.e. the time the step would take if no worker waited
and there were no communication; actual = summary wall_s.

Afterwards the schedule is also replayed through the scheduler's controller object
(scheduler/control.py) without processes, for several alignments of its measurement
windows against the speed changes: a live run sees only one of them.

    python benchmarks/heterogeneity.py [--epochs 15] [--schedule-steps 200] [--quick] [--keep-runs]
        [--only HL8,schedule] [--variants uniform,affine] [--ms-per-step 3] [--ms-per-sample 4]

Prints a line per run and the tables; writes benchmarks/results/heterogeneity.md.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from jobs import run_job  # noqa: E402
from report import machine_lines, runs_dir  # noqa: E402

from omnips.batching import initial_batches  # noqa: E402
from omnips.launch import WorkerSpec  # noqa: E402

LEVELS = {  # relative speeds ("cores") of the 4 workers
    "HL1": (12, 12, 12, 12),
    "HL2": (12, 12, 8, 16),
    "HL4": (9, 9, 6, 24),
    "HL8": (6, 6, 4, 32),
}
SCHEDULE = ("HL1", "HL2", "HL4", "HL8", "HL8", "HL4", "HL2", "HL1")
REFERENCE_SPEED = 12  # speed at which a sample costs C ms (F = 1)
VARIANTS = ("uniform", "static", "proportional", "affine")
JOB_TIMEOUT_S = 300

TARGET_STATIC_EFF = 0.90
TARGET_SCHEDULE_EFF = 0.85
TARGET_REDUCTION_SHARE = 0.90


@dataclass(frozen=True)
class Scenario:
    name: str
    slowdowns: tuple[str, ...]  # per worker, a --slowdown value
    capacities: tuple[float, ...]
    budget: tuple[str, ...]  # --epochs N or --max-steps N
    factors: tuple[tuple[float, ...], ...]  # per block (one for a static level), per worker


def factor(speed: float) -> float:
    return REFERENCE_SPEED / speed


def fmt_factor(f: float) -> str:
    return f"{f:.6g}"


def static_scenario(level: str, epochs: float) -> Scenario:
    speeds = LEVELS[level]
    fs = tuple(factor(s) for s in speeds)
    return Scenario(level, tuple(fmt_factor(f) for f in fs), tuple(float(s) for s in speeds),
                    ("--epochs", f"{epochs:g}"), (fs,))


def schedule_scenario(steps: int) -> Scenario:
    block = steps // len(SCHEDULE)
    if block < 1:
        raise SystemExit(f"--schedule-steps {steps} leaves no step per block")
    per_block = tuple(tuple(factor(s) for s in LEVELS[lv]) for lv in SCHEDULE)
    slowdowns = tuple(",".join(f"{k * block}:{fmt_factor(per_block[k][i])}" for k in range(len(SCHEDULE)))
                      for i in range(4))
    return Scenario("schedule", slowdowns, tuple(float(s) for s in LEVELS["HL1"]),
                    ("--max-steps", str(steps)), per_block)


def scheduler_args(variant: str, scenario: Scenario, args) -> list[str]:
    common = ["--mode", "bsp", "--model", "mlp", "--dataset", "digits", "--global-batch", str(args.global_batch),
              "--lr", "0.05", "--seed", "0", *scenario.budget]
    if variant in ("uniform", "static"):
        return [*common, "--batching", variant]
    return [*common, "--batching", "dynamic", "--controller", variant, "--adjust-every", str(args.adjust_every),
            "--deadband", str(args.deadband)]


def worker_specs(variant: str, scenario: Scenario, args) -> list[WorkerSpec]:
    dynamic = variant in ("proportional", "affine")
    caps = [1.0] * 4 if (dynamic and args.dynamic_start == "uniform") else scenario.capacities
    return [WorkerSpec(capacity=c, slowdown=s, ms_per_step=args.ms_per_step, ms_per_sample=args.ms_per_sample)
            for c, s in zip(caps, scenario.slowdowns)]


# -- one run -----------------------------------------------------------------------
def run_one(root: Path, scenario: Scenario, variant: str, args) -> dict:
    run_dir = root / f"{scenario.name}-{variant}"
    t0 = time.monotonic()
    summary, events = run_job(run_dir, scheduler_args(variant, scenario, args), 1,
                              worker_specs(variant, scenario, args), f"{scenario.name} {variant}", JOB_TIMEOUT_S)
    return {"scenario": scenario.name, "variant": variant, "summary": summary, "run_dir": str(run_dir),
            "elapsed_s": time.monotonic() - t0, **analyse(events, summary, scenario)}


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


# -- theory ------------------------------------------------------------------------
def theoretical_reduction(speeds, a_ms: float, c_ms: float, total: int) -> dict:
    fs = [factor(s) for s in speeds]
    n = len(fs)
    uniform = max(f * (a_ms + c_ms * total / n) for f in fs)
    # equal time T: sum_i (T/F_i - A)/C = B  =>  T = (B*C + n*A) / sum 1/F_i (all batches > 0 here)
    t = (total * c_ms + n * a_ms) / sum(1 / f for f in fs)
    batches = [(t / f - a_ms) / c_ms for f in fs]
    return {"uniform_ms": uniform, "ideal_ms": t, "reduction": 1 - t / uniform, "batches": batches,
            "integer": best_integer_plan(fs, a_ms, c_ms, total)}


def best_integer_plan(fs, a_ms: float, c_ms: float, total: int) -> tuple[list[int], float]:
    """The integer batches (each >= 1, summing to `total`) with the smallest slowest-worker
    time: start from 1 each and give every further sample to the worker that would then
    finish first (exact for times increasing in the batch)."""
    b = [1] * len(fs)
    for _ in range(total - len(fs)):
        i = min(range(len(fs)), key=lambda k: fs[k] * (a_ms + c_ms * (b[k] + 1)))
        b[i] += 1
    return b, max(f * (a_ms + c_ms * x) for f, x in zip(fs, b))


# -- controller replay ---------------------------------------------------------------
def replay_schedule(controller: str, phase: int, args, steps: int) -> tuple[float, int]:
    """The dynamic schedule fed through the scheduler's own controller (scheduler/control.py),
    without processes: exact emulated compute times, every worker reporting every step, a new
    plan used from the step after next (as server 0 hands it on). `phase` extra HL1 steps at
    the start shift where the measurement windows fall relative to the speed changes, which in
    a live run depends on how the reports happen to interleave. Returns (balance, adjustments)."""
    from omnips.batching import BatchPlan
    from omnips.job import JobSpec
    from omnips.scheduler.control import BatchControl

    job = JobSpec(num_workers=4, global_batch=args.global_batch, batching="dynamic", controller=controller,
                  adjust_every=args.adjust_every, deadband=args.deadband, max_steps=steps + phase)
    plan = BatchPlan(0, tuple(initial_batches("uniform", args.global_batch, [1] * 4)))
    control = BatchControl(job, plan)
    block = steps // len(SCHEDULE)
    pending = []
    ideal = slowest = 0.0
    for step in range(steps + phase):
        while pending and pending[0][0] <= step:
            plan = pending.pop(0)[1]
        level = SCHEDULE[min(max(step - phase, 0) // block, len(SCHEDULE) - 1)]
        times = [factor(v) * (args.ms_per_step + args.ms_per_sample * b) / 1000
                 for v, b in zip(LEVELS[level], plan.batches)]
        ideal += sum(plan.batches) / sum(b / t for b, t in zip(plan.batches, times))
        slowest += max(times)
        for rank in range(4):
            control.on_step(rank, plan.batches[rank], times[rank])
            if control.ready:
                before = control.plan
                control.replan()
                if control.plan != before:
                    pending.append((step + 2, control.plan))
    return ideal / slowest, control.adjustments


REPLAY_PHASES = range(8)  # two measurement windows' worth of alignments
REPLAY_SMALL_A = 3.0  # the contrast: a small fixed overhead, C raised to keep the step time at an equal share


def share(args) -> float:
    return args.global_batch / 4


def small_overhead(args) -> tuple[float, float]:
    step = args.ms_per_step + args.ms_per_sample * share(args)
    return REPLAY_SMALL_A, (step - REPLAY_SMALL_A) / share(args)


def replay_lines(args) -> list[str]:
    lines = ["| A ms | C ms | controller | " + " | ".join(f"phase {k}" for k in REPLAY_PHASES) + " |",
             "|---:|---:|---|" + "---:|" * len(REPLAY_PHASES)]
    for a_ms, c_ms in ((args.ms_per_step, args.ms_per_sample), small_overhead(args)):
        other = argparse.Namespace(**{**vars(args), "ms_per_step": a_ms, "ms_per_sample": c_ms})
        for controller in ("proportional", "affine"):
            cells = [replay_schedule(controller, k, other, args.schedule_steps) for k in REPLAY_PHASES]
            row = " | ".join(f"{b:.3f} / {n}" for b, n in cells)
            lines.append(f"| {a_ms:g} | {c_ms:g} | {controller} | {row} |")
    return lines


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE.parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{rev}{' with uncommitted changes' if dirty else ''}" if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# -- output ------------------------------------------------------------------------
def yes(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def results_table(results: list[dict]) -> list[str]:
    lines = ["| scenario | variant | samples/s | wall_s | test acc | adjustments | final batches | efficiency | "
             "balance | step ms | overhead ms/step | mean wait frac |",
             "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        s = r["summary"]
        wait = statistics.mean(r["wait_fraction"]) if r["wait_fraction"] else float("nan")
        lines.append(f"| {r['scenario']} | {r['variant']} | {s['samples_per_s']:.0f} | {s['wall_s']:.2f} | "
                     f"{s['final_test_accuracy']:.4f} | {s['adjustments']} | "
                     f"{'/'.join(map(str, s['final_batches']))} | "
                     f"{r['efficiency']:.3f} | {r['balance']:.3f} | {r['step_ms']:.1f} | "
                     f"{r['overhead_ms_per_step']:.1f} | {wait:.2f} |")
    return lines


def targets(results: list[dict], args) -> tuple[list[str], list[tuple[str, bool]]]:
    by = {(r["scenario"], r["variant"]): r for r in results}
    rows, verdicts = [], []
    for level in LEVELS:
        r = by.get((level, "affine"))
        if r:
            ok = r["efficiency"] >= TARGET_STATIC_EFF
            rows.append(f"| BSP efficiency, affine, {level} | >= {TARGET_STATIC_EFF:.2f} | {r['efficiency']:.3f} "
                        f"| {yes(ok)} |")
            verdicts.append((f"efficiency {level}", ok))
    r = by.get(("schedule", "affine"))
    if r:
        ok = r["efficiency"] >= TARGET_SCHEDULE_EFF
        rows.append(f"| BSP efficiency, affine, dynamic schedule | >= {TARGET_SCHEDULE_EFF:.2f} | {r['efficiency']:.3f} | {yes(ok)} |")
        verdicts.append(("efficiency schedule", ok))
    for scen in [*LEVELS, "schedule"]:
        a, p = by.get((scen, "affine")), by.get((scen, "proportional"))
        if a and p:
            na, np_ = a["summary"]["adjustments"], p["summary"]["adjustments"]
            ok = na < np_
            label = "dynamic schedule" if scen == "schedule" else scen
            if scen == "schedule":
                rows.append(f"| adjustments affine < proportional, {label} | affine < proportional | "
                            f"{na} vs {np_} (efficiency {a['efficiency']:.3f} vs {p['efficiency']:.3f}) | {yes(ok)} |")
                verdicts.append(("fewer adjustments (schedule)", ok))
            else:  # informative
                rows.append(f"| adjustments affine vs proportional, {label} (info) | - | {na} vs {np_} | "
                            f"{'fewer' if ok else 'not fewer'} |")
    u, a = by.get(("HL8", "uniform")), by.get(("HL8", "affine"))
    if u and a:
        th = theoretical_reduction(LEVELS["HL8"], args.ms_per_step, args.ms_per_sample, args.global_batch)
        measured = 1 - a["summary"]["wall_s"] / u["summary"]["wall_s"]
        ok = measured >= TARGET_REDUCTION_SHARE * th["reduction"]
        rows.append(f"| HL8 time reduction affine vs uniform | >= {TARGET_REDUCTION_SHARE:.1f} x {th['reduction']:.1%} "
                    f"= {TARGET_REDUCTION_SHARE * th['reduction']:.1%} | {measured:.1%} "
                    f"({measured / th['reduction']:.2f} of the maximum) | {yes(ok)} |")
        verdicts.append(("HL8 reduction", ok))
    return ["| target | wanted | measured | verdict |", "|---|---|---|---|", *rows], verdicts


def theory_lines(args) -> list[str]:
    lines = ["| level | F per worker | uniform step ms | equal-time step ms | equal-time batches | max reduction | "
             "best integer batches | its step ms | capacity split | its step ms |",
             "|---|---|---:|---:|---|---:|---|---:|---|---:|"]
    for level, speeds in LEVELS.items():
        th = theoretical_reduction(speeds, args.ms_per_step, args.ms_per_sample, args.global_batch)
        (ib, it) = th["integer"]
        cap = initial_batches("static", args.global_batch, speeds)
        cap_ms = max(factor(s) * (args.ms_per_step + args.ms_per_sample * b) for s, b in zip(speeds, cap))
        lines.append(f"| {level} | {'/'.join(f'{factor(s):.3g}' for s in speeds)} | {th['uniform_ms']:.1f} | "
                     f"{th['ideal_ms']:.1f} | {'/'.join(f'{b:.1f}' for b in th['batches'])} | {th['reduction']:.1%} | "
                     f"{'/'.join(map(str, ib))} | {it:.1f} | {'/'.join(map(str, cap))} | {cap_ms:.1f} |")
    return lines


def noise_lines(results: list[dict]) -> list[str]:
    """HL1 runs all have equal batches: their spread is the host's noise."""
    same = [r["efficiency"] for r in results if r["scenario"] == "HL1"]
    if len(same) < 2:
        return []
    return ["", f"At HL1 every variant trains with equal batches: their efficiencies ({min(same):.3f} to "
                f"{max(same):.3f}) show the run-to-run noise of this host."]


def block_lines(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        if "blocks" not in r:
            continue
        out.append(f"\n{r['variant']}: " + ", ".join(
            f"{b['level']} eff {b['efficiency']:.2f} bal {b['balance']:.2f} adj {b['adjustments']}" for b in r["blocks"]))
    return out


def assign_lines(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        if r["variant"] in ("proportional", "affine"):
            plans = "; ".join(f"{s}:{'/'.join(map(str, b))}" for s, b in r["assigns"])
            out.append(f"- {r['scenario']} {r['variant']}: {plans}")
    return out


def render(results, args, total_s, scenarios, revisions) -> str:
    load = os.getloadavg()
    try:
        import torch
        torch_v = torch.__version__
    except ImportError:
        torch_v = "?"
    tgt, _ = targets(results, args)
    sched = next((s for s in scenarios if s.name == "schedule"), None)
    lines = [
        "# Dynamic batching on emulated heterogeneous clusters",
        "",
        *machine_lines(),
        f"- torch {torch_v}; load average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
        "(other work on these cores adds noise)",
        f"- code: git {revisions[0]}" + ("" if revisions[0] == revisions[1] else
                                         f" at the start, {revisions[1]} at the end (the code changed during the run)"),
        f"- command: `python benchmarks/heterogeneity.py {' '.join(sys.argv[1:])}` ({total_s:.0f} s in all)",
        f"- job: BSP, 4 workers (1 torch thread each), 1 server, mlp on digits (1438 train / 359 test), "
        f"--global-batch {args.global_batch}, sgd --lr 0.05 momentum 0.9, --seed 0",
        f"- static levels: --epochs {args.epochs:g}"
        + (f"; dynamic schedule: --max-steps {args.schedule_steps}, blocks of {args.schedule_steps // len(SCHEDULE)} steps "
           f"{' -> '.join(SCHEDULE)}" if sched else ""),
        f"- dynamic variants: --adjust-every {args.adjust_every}, --deadband {args.deadband}; "
        f"start: the probe's plan (every worker times passes of 2 and 4 samples before step 0; the split by "
        f"declared capacities it replaces: {'the speeds at a static level, equal in the schedule' if args.dynamic_start == 'capacity' else 'equal batches'})",
        f"- emulation (virtual device, same on every worker): A = --emulate-ms-per-step {args.ms_per_step:g} ms, "
        f"C = --emulate-ms-per-sample {args.ms_per_sample:g} ms; worker of speed s has slowdown F = 12/s, so a step's "
        f"compute phase lasts F*(A + C*b) ms (b = {share(args):g} at speed 12: {args.ms_per_step + share(args) * args.ms_per_sample:g} ms)",
        "- levels (relative speeds): " + ", ".join(f"{k} {'/'.join(map(str, v))}" for k, v in LEVELS.items()),
        "- static: --capacity = the worker's speed (HL1 capacities, i.e. equal, for the schedule)",
        "",
        "Definitions:",
        "",
        "- efficiency = ideal / wall_s, ideal = sum over BSP steps t of B_t / X_t, X_t = sum_i b_it / c_it "
        "(c_it: worker i's reported compute_s in step t): the time the steps would take if every worker ran "
        "at its own throughput and nobody waited, with no communication; wall_s from summary.json "
        "(the first probe pass, or the first step where there is none, to the last step; evaluations included).",
        "- balance = ideal / sum_t max_i c_it: the load balance alone (1 = all workers' compute phases equal).",
        "- overhead ms/step = (wall_s - sum_t max_i c_it) / steps: communication, barrier, evaluations, host noise.",
        "- mean wait frac: mean over workers of summary worker_wait_fraction (barrier + network share of wall_s).",
        "- adjustments: summary 'adjustments' (plan changes after the start).",
        "- theoretical reduction at HL8: 1 - T/U with U = max_i F_i*(A + C*B/4) (uniform) and T the equal-time "
        "solution of sum_i (T/F_i - A)/C = B; measured: 1 - wall_s(affine)/wall_s(uniform).",
        "",
        "## Results",
        "",
        *results_table(results),
        *noise_lines(results),
        "",
        "## Targets",
        "",
        *tgt,
        "",
        "## Emulated cluster: equal-time plans and the maximum gain over uniform batches",
        "",
        "From the emulation parameters alone (no communication): the real-valued equal-time plan, the best "
        "integer plan (smallest slowest-worker time) and the capacity-proportional split that static uses "
        "(and the dynamic variants' probe replaces before step 0).",
        "",
        *theory_lines(args),
    ]
    blocks = block_lines(results)
    if blocks:
        lines += ["", "## Dynamic schedule, block by block",
                  "", "(efficiency and balance per block of steps; adj = plan changes made within the block)", *blocks]
    if sched:
        lines += ["", "## The schedule replayed through the controller (no processes)", "",
                  "scheduler/control.py's BatchControl fed the exact emulated compute times of the schedule "
                  f"(--adjust-every {args.adjust_every}, --deadband {args.deadband}), a new plan used from the step "
                  "after next; phase k starts with k extra HL1 steps, which moves the measurement windows "
                  "against the speed changes (in a live run that alignment depends on how reports interleave). "
                  "Cells: balance (ideal / slowest-worker compute, summed over steps) / adjustments. The second "
                  f"pair of rows uses a small fixed overhead (A = {small_overhead(args)[0]:g} ms, "
                  f"C = {small_overhead(args)[1]:.3g} ms: the same step time at b = {share(args):g}), where a line "
                  "through the origin describes a worker almost exactly and the proportional rule is nearly as good.", "",
                  *replay_lines(args)]
    lines += ["", "## Batch plans of the dynamic variants (step: batches)", "", *assign_lines(results)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=float, default=None, help="budget of the static levels (default 15, --quick 4)")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="budget (--max-steps) of the dynamic schedule (default 200, --quick 80)")
    p.add_argument("--adjust-every", type=int, default=5)
    p.add_argument("--deadband", type=float, default=0.05)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--ms-per-step", type=float, default=30.0, help="A, emulated fixed ms per step")
    p.add_argument("--ms-per-sample", type=float, default=3.0, help="C, emulated ms per sample at speed 12")
    p.add_argument("--dynamic-start", choices=("capacity", "uniform"), default="capacity",
                   help="the dynamic variants' declared capacities: the speeds (paper: by core count) or all equal")
    p.add_argument("--quick", action="store_true", help="smoke run: HL8 and a short schedule only")
    p.add_argument("--only", default=None, help="comma-separated scenarios to run (HL1,HL2,HL4,HL8,schedule)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated batching variants to run")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories (printed)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "heterogeneity.md")
    args = p.parse_args(argv)
    if args.epochs is None:
        args.epochs = 4.0 if args.quick else 15.0
    if args.schedule_steps is None:
        args.schedule_steps = 80 if args.quick else 200
    names = ["HL8", "schedule"] if args.quick else [*LEVELS, "schedule"]
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [n for n in names if n not in LEVELS and n != "schedule"] + [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown scenario or variant: {', '.join(unknown)}")
    scenarios = [schedule_scenario(args.schedule_steps) if n == "schedule" else static_scenario(n, args.epochs)
                 for n in names]

    revision = git_revision()
    results = []
    t0 = time.monotonic()
    with runs_dir("omnips-heterogeneity-", args.keep_runs) as root:
        total = len(scenarios) * len(variants)
        for scenario in scenarios:
            for variant in variants:
                r = run_one(root, scenario, variant, args)
                results.append(r)
                s = r["summary"]
                print(f"[{len(results)}/{total}] {scenario.name:8s} {variant:12s} wall {s['wall_s']:6.2f} s  "
                      f"{s['samples_per_s']:6.0f} samples/s  acc {s['final_test_accuracy']:.3f}  "
                      f"adj {s['adjustments']:2d}  batches {s['final_batches']}  eff {r['efficiency']:.3f}  "
                      f"({r['elapsed_s']:.0f} s with start-up)", flush=True)
    text = render(results, args, time.monotonic() - t0, scenarios, (revision, git_revision()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print()
    print(text)
    _, verdicts = targets(results, args)
    print("targets: " + ", ".join(f"{name} {yes(ok)}" for name, ok in verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
