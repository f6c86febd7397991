"""benchmarks/heterogeneity.py's report: the emulated cluster's theory (the equal-time plans and
the most a plan can gain), the dynamic schedule replayed through the controller without
processes, the targets, and the markdown page."""

import argparse
import os
import statistics
import sys

from efficiency import LEVELS, SCHEDULE, factor
from report import code_version, machine_lines

from omnips.batching import initial_batches

TARGET_STATIC_EFF = 0.90
TARGET_SCHEDULE_EFF = 0.85
TARGET_REDUCTION_SHARE = 0.90


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


def render(results, args, total_s, scenarios, started_at: str) -> str:
    """The results page; `started_at`: report.code_version() when the runs began."""
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
        *([] if started_at == code_version() else [f"- code at the start: {started_at} (it changed during the run)"]),
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
