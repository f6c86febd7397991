#!/usr/bin/env python
"""The dynamic-batching controller at scale, with modelled workers instead of processes.

Drives the scheduler's own controller object (scheduler/control.BatchControl, and
through it omnips/batching.py) with N workers whose compute phase takes
F_i * (a_i + c_i * b) seconds, BSP: a step lasts as long as its slowest worker plus a
fixed communication time. Speeds F_i are drawn from the paper's heterogeneity range
(up to 8x apart); at mid-run a quarter of the workers become 3x slower. The job
starts as a live one does: every worker times one pass of each probe size (2 and 4
samples, with the same noise) and the first plan comes from those points, or, with
--no-probe, from equal batches (the declared capacities, all equal). Two ranges
of fixed costs a_i: with up to 10 ms, from 64 workers on some worker's fixed cost
alone exceeds everyone's equal time and holds the step whatever the plan; with up
to 2.5 ms, the plan decides. A new plan is used from the step after next, as
server 0 hands it on in a live run. Noise of
+-`noise` per step and worker is either compute jitter (the device really varies:
the barrier waits for the slowest draw) or timer noise (the device does not, only
the time the controller is told does). Reported per N and kind of noise:

* efficiency over the steps after the first convergence (the speed change included),
  against (i) the nobody-waits ideal: every worker at its own throughput that step,
  nobody waiting, and (ii) the oracle plan: the best integer equal-time plan from the
  true a_i, c_i, F_i (known at once, also after the change), run through the same
  noise; against (ii) also over the steps before the change (noise alone); and the
  oracle's own efficiency against (i), what no plan can beat;
* adjustments to converge at the start and after the speed change: plan changes
  until the plan's noise-free step time is within 5 % of the oracle plan's;
* the controller's CPU time per decision (one `replan`), median and max, and per
  worker report (`on_step` and `ready`, as the scheduler calls them), mean;
* at the largest N, a slow drift instead of the change (the quarter slows down a
  little every step), against the oracle that follows it, with the time models as
  they are and with their long averages kept as the short ones are (the baseline);
* at 3 to 16 workers, a transient slowdown instead (1.3x for 3 windows), with plans
  the deadband holds back taken once they persist and with the deadband alone (the
  baseline): whether the plan comes back to the best one afterwards;
* at 8 to 256 workers, held-back plans taken as the controller does and with the same
  plan only (the baseline): whether the plan settles closer to the best one, and at how
  many more plan changes;
* at 64 workers and the largest N, a first step at a new batch size charged 5 % (and
  how much longer it took on this machine's CPU): what the plan changes cost;
* small clusters whose time is not a line in the batch (it steps up every few
  samples), the same two ways: how often plans go back and forth, and which ends faster;
* at the largest N, what each worker report costs the scheduler besides the controller:
  decoding it and writing its metrics line.

    python benchmarks/simulate.py [--workers 4,64,1024,4096] [--noise 0.05] [--steps 240] [--no-probe]

Prints a table and writes it to benchmarks/results/simulate.md.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish  # noqa: E402
from simulation import (COMM_S, DRIFTS, KINDS, SCENARIOS, SEEDS, TILED_CASES, TRANSIENT_SLOWDOWN,  # noqa: E402
                        TRANSIENT_WINDOWS, TRANSIENT_WORKERS, WARMUP, WARMUP_WORKERS, WIDE_WORKERS, as_it_is_and,
                        deadband_only, report_path, same_plan_only, seed_means, short_averages_only, simulate,
                        since_change, summarise, tiled, warm_up_cost)
from omnips.batching import PROBE_BATCHES  # noqa: E402
from omnips.scheduler import control  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="4,64,1024,4096")
    p.add_argument("--noise", type=float, default=0.05)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--adjust-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="start from equal batches instead of the probe's plan (the scheduler's --no-probe)")
    p.add_argument("--warm-up-reps", type=int, default=15,
                   help="batch-size changes each way timed for the first step at a new size")
    p.add_argument("--tiled-cases", type=int, default=TILED_CASES,
                   help="clusters in the table of workers whose time is not a line")
    p.add_argument("--out", type=Path, default=HERE / "results" / "simulate.md")
    args = p.parse_args(argv)
    start, load = time.monotonic(), os.getloadavg()[0]

    def run(size, kind, seed=args.seed, scenario=SCENARIOS[-1], **change):
        """One simulation with the command line's settings, in `scenario` (the last by default)."""
        fixed, per_worker = scenario
        return simulate(size, args.steps, args.noise, kind, args.adjust_every, seed, fixed, per_worker, args.probe,
                        **change)

    def over_seeds(size, kind, **change):
        return [run(size, kind, seed, **change) for seed in range(args.seed, args.seed + SEEDS)]

    rows = []
    for fixed, per_worker in SCENARIOS:
        for n in [int(v) for v in args.workers.split(",")]:
            for kind in KINDS:
                s = summarise(run(n, kind, scenario=(fixed, per_worker)))
                s["fixed"], s["per_worker"] = fixed, per_worker
                print(f"a {fixed[0]:g}..{fixed[1]:g} ms, {per_worker} samples a worker, {n} workers, {kind}: efficiency {s['vs_ideal']:.3f} of "
                      f"nobody-waits, {s['vs_oracle']:.3f} of the oracle plan ({s['calm_vs_oracle']:.3f} before the change; it makes "
                      f"{s['oracle_vs_ideal']:.3f}), converged in {s['first']} / {s['after_change']} adjustments, "
                      f"decision {s['decision_ms']:.2f} ms (max {s['decision_max_ms']:.2f}), "
                      f"{s['report_us']:.1f} us a report", flush=True)
                rows.append(s)
    # a slow drift instead of the speed change, at the largest size: what the long averages cost
    # where they trail, against models with short ones only, in the same runs otherwise
    fixed, per_worker = SCENARIOS[-1]
    n = max(int(v) for v in args.workers.split(","))
    drift_rows = []
    for per_window in DRIFTS:
        for kind in KINDS:
            for short, context in as_it_is_and(short_averages_only):
                with context():
                    d = since_change(run(n, kind, drift=per_window / args.adjust_every))
                model = "short" if short else "long"
                print(f"drift {per_window:.1%} a window, {n} workers, {kind}, {model} averages: "
                      f"{d['vs_oracle']:.3f} of the oracle plan, settled {d['settled']:.3f}, {d['changes']} plan changes",
                      flush=True)
                drift_rows.append((per_window, kind, model, d))
    # a transient slowdown on small clusters (the same scenario): whether the plan comes back to
    # the best one after it, with held-back plans taken once they persist and with the deadband alone
    transient_rows = []
    for size in TRANSIENT_WORKERS:
        for kind in KINDS:
            for alone, context in as_it_is_and(deadband_only):
                with context():
                    runs = [since_change(r) for r in over_seeds(size, kind, transient=TRANSIENT_WINDOWS * args.adjust_every)]
                t = {k: float(np.mean([d[k] for d in runs])) for k in ("vs_oracle", "settled")}
                t["changes"] = [d["changes"] for d in runs]
                print(f"transient, {size} workers, {kind}, deadband alone {alone}: {t['vs_oracle']:.3f} of the oracle "
                      f"plan, settled {t['settled']:.4f}, plan changes {t['changes']}", flush=True)
                transient_rows.append((size, kind, alone, t))
    # mid-size clusters, noise alone: held-back plans taken as they are and with the same plan only
    wide_rows = []
    for size in [w for w in WIDE_WORKERS if w <= n]:
        for kind in KINDS:
            for same, context in as_it_is_and(same_plan_only):
                with context():
                    w = seed_means(over_seeds(size, kind), ("calm_vs_oracle", "settled"))
                print(f"held-back plans, {size} workers, {kind}, same plan only {same}: {w}", flush=True)
                wide_rows.append((size, kind, same, w))
    # a first step at a new batch size charged (a warm-up): what the plan changes cost
    warm_rows = []
    for size in sorted({*(w for w in WARMUP_WORKERS if w < n), n}):
        for kind in KINDS:
            for warmup in (0.0, WARMUP):
                runs = over_seeds(size, kind, warmup=warmup)
                w = seed_means(runs, ("calm_vs_oracle", "vs_oracle"))
                w["moved"] = float(np.mean([np.mean(r["moved"]) for r in runs if r["moved"]] or [0.0]))
                print(f"warm-up {warmup:.0%}, {size} workers, {kind}: {w}", flush=True)
                warm_rows.append((size, kind, warmup, w))
    warm_measured = warm_up_cost(args.warm_up_reps)
    print(f"first step at a new batch size: {warm_measured}", flush=True)
    tiles = tiled(args.tiled_cases, args.seed)
    print(f"tiled workers: {tiles}", flush=True)
    path = report_path(n)
    controller_us = max(s["report_us"] for s in rows if s["n"] == n)
    path["total_us"] = path["decode_us"] + path["event_us"] + controller_us
    print(f"a report through the scheduler: {path}", flush=True)
    lines = [
        "# The controller simulated at scale (BSP, modelled workers)", "",
        *machine_lines(),
        f"- command: `python benchmarks/simulate.py {' '.join(sys.argv[1:])}` ({time.monotonic() - start:.0f} s; "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after: CPU times are this process's, "
        f"a busy machine still slows them)",
        f"- workers: compute F*(a + c*b) s, a as below, c in 0.5..2 ms, speeds 1..8 (F = 1/speed), "
        f"±{args.noise:.0%} noise per step and worker; the global batch as below; {1000 * COMM_S:g} ms of communication per step; a quarter of the workers 3x slower from step "
        f"{args.steps // 2} of {args.steps}; --adjust-every {args.adjust_every}",
        "- start: " + (f"the probe, one pass of {' and '.join(map(str, PROBE_BATCHES))} samples on every worker (timed through "
                       "the same noise), and the plan from those points, as a live job starts by default"
                       if args.probe else "equal batches (--no-probe)"), "",
        "| a, ms | samples a worker | workers | noise | efficiency: of nobody-waits (i) | of the oracle plan (ii) | of (ii), noise alone | the oracle "
        "plan's, of (i) | adjustments to converge: start / after the change | settled plan's step time, of the "
        "oracle's | steps on the old plan after the change | decision CPU ms, median (max) | CPU a report, us |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for s in rows:
        lines.append(f"| {s['fixed'][0]:g}..{s['fixed'][1]:g} | {s['per_worker']} | {s['n']} | {s['kind']} | {s['vs_ideal']:.3f} | "
                     f"{s['vs_oracle']:.3f} | {s['calm_vs_oracle']:.3f} | "
                     f"{s['oracle_vs_ideal']:.3f} | {s['first']} / {s['after_change']} | {s['settled']:.3f} | "
                     f"{s['old_plan_steps']} | "
                     f"{s['decision_ms']:.2f} ({s['decision_max_ms']:.2f}) | {s['report_us']:.1f} |")
    lines += ["", "Noise: jitter, the device's compute time varies (the barrier waits for the slowest draw); "
              "timer, only the measurement does (the device takes its modelled time). Efficiency: the time the "
              "steps after the first convergence (the speed change included) would take, over what they took; "
              "communication counted in both; noise alone: the same from the first convergence to the speed change. (i) nobody waits: every worker at its own throughput that step; "
              "(ii) the oracle plan: the best integer equal-time plan from the true lines, known at once (after "
              "the change too), through the same noise. The oracle's column is what no plan can beat against "
              "(i): with jitter the slowest of N workers is near +noise, and a worker whose fixed cost alone "
              "exceeds the others' equal time (held at one sample) makes everyone wait. Converged: the plan's "
              "noise-free step time within 5 % of the oracle plan's; None: not within the phase. Settled: the median, "
              "over the last fifth of each phase, of the plan's noise-free step time over the oracle plan's (what "
              "the time models' errors cost once converged: the slowest of N workers' errors sets the step). Steps "
              "on the old plan: from the speed change to the first step that runs a plan decided after it. "
              "Decision: one `replan`; a report: `on_step` and `ready`, as the scheduler calls them for every report.",
              "", f"## A slow drift instead ({n} workers, a {fixed[0]:g}..{fixed[1]:g} ms, {per_worker} samples a worker)", "",
              f"From step {args.steps // 2} the same quarter of the workers slows down by the given fraction a window "
              f"(of {args.adjust_every} steps, compounding every step) instead of becoming 3x slower at once; the oracle "
              "plan follows the drift at every step. Long averages: the time models as they are; short: their long "
              "averages kept as the short ones are (REPEAT = FORGET), as they fitted before they had long ones, in "
              "runs otherwise the same.", "",
              "| drift a window | noise | averages | efficiency of the oracle plan, from the drift's start | "
              "settled plan's step time, of the oracle's (last fifth) | plan changes |",
              "|---:|---|---|---:|---:|---:|"]
    for per_window, kind, model, d in drift_rows:
        lines.append(f"| {per_window:.1%} | {kind} | {model} | {d['vs_oracle']:.3f} | {d['settled']:.3f} | {d['changes']} |")
    over = f"(a {fixed[0]:g}..{fixed[1]:g} ms, {per_worker} samples a worker, seeds {args.seed}-{args.seed + SEEDS - 1})"
    lines += ["", f"## A transient slowdown on small clusters {over}", "",
              f"From step {args.steps // 2} a quarter of the workers (one of 3) is {TRANSIENT_SLOWDOWN:g}x slower for "
              f"{TRANSIENT_WINDOWS} windows, then as fast as before; the oracle plan follows at once. Held back "
              f"taken: the controller as it is, a plan the deadband holds back is taken once {control.PERSIST} "
              f"decisions running propose it, at least {control.MIN_GAIN:.1%} faster (and, if it ran before, it was "
              f"measured that much faster); deadband alone: never (the "
              "baseline), in runs otherwise the same. Means over the seeds; plan changes per seed.", "",
              "| workers | noise | held-back plans | efficiency of the oracle plan, from the slowdown's start | "
              "settled plan's step time, of the oracle's (last fifth) | plan changes |",
              "|---:|---|---|---:|---:|---|"]
    for size, kind, alone, t in transient_rows:
        lines.append(f"| {size} | {kind} | {'deadband alone' if alone else 'taken'} | {t['vs_oracle']:.3f} | "
                     f"{t['settled']:.4f} | {', '.join(map(str, t['changes']))} |")
    lines += ["", f"## Held-back plans on mid-size clusters {over}", "",
              "From tens of workers on, the plan the deadband holds back moves by a sample here and there from one "
              "decision to the next (the worst of many models' errors), so the same plan rarely persists. As it "
              f"is: also taken once {control.PERSIST} decisions running hold back plans predicted at least "
              f"{control.WIDE_GAIN:.0%} faster, whichever they are; same plan only: not (the baseline), in runs "
              "otherwise the same. Over the steps from the first convergence to the speed change (noise alone); "
              "settled: the last fifth of each phase; plan changes over the whole run. Means over the seeds.", "",
              "| workers | noise | held-back plans | efficiency of the oracle plan, noise alone | settled plan's step "
              "time, of the oracle's | plan changes |", "|---:|---|---|---:|---:|---:|"]
    for size, kind, same, w in wide_rows:
        lines.append(f"| {size} | {kind} | {'same plan only' if same else 'as it is'} | "
                     f"{w['calm_vs_oracle']:.4f} | {w['settled']:.4f} | {w['changes']:.1f} |")
    lines += ["", f"## Plan changes charged {over}", "",
              "Elsewhere a plan change costs nothing. Here a worker's first step on a new batch size takes "
              f"{WARMUP:.0%} longer (the oracle plan's workers too, when the speed change moves it), in runs otherwise "
              "the same. Measured on this machine's CPU, one torch thread, the first forward and backward pass at a "
              "new size took longer than the passes after it by " + ", ".join(
                  f"{v:.1%} ({case})" for case, v in warm_measured) + ". Workers moved: per plan change. Means over "
              "the seeds.", "",
              "| workers | noise | first step at a new size | efficiency of the oracle plan, noise alone | "
              "efficiency of the oracle plan | plan changes | workers moved |", "|---:|---|---:|---:|---:|---:|---:|"]
    for size, kind, warmup, w in warm_rows:
        lines.append(f"| {size} | {kind} | +{warmup:.0%} | {w['calm_vs_oracle']:.4f} | {w['vs_oracle']:.4f} | "
                     f"{w['changes']:.1f} | {w['moved']:.0f} |")
    lines += ["", "## Workers whose time is not a line (held-back plans taken, against the deadband alone)", "",
              f"{tiles['cases']} clusters of 2-5 workers whose time steps up every 4, 8 or 16 samples (a GPU's tiles: "
              "part of a sample's cost is paid per started tile), exact times, 50 decisions each, from equal "
              "batches. Back and forth: at least 3 held-back plans taken and 2 returns to a plan run before. "
              "Final plan: its step time against the one the deadband alone ends on.", "",
              "| clusters | back and forth | final plan faster | slower | mean ratio |", "|---:|---:|---:|---:|---:|",
              f"| {tiles['cases']} | {tiles['back_and_forth']} | {tiles['faster']} | {tiles['slower']} | "
              f"{tiles['mean']:.4f} |"]
    lines += ["", f"## A report through the scheduler ({n} workers)", "",
              "What the scheduler spends on each worker report besides the controller (the main table's CPU a "
              f"report, the largest at {n} workers): decoding it (codec.decode, every check included) and writing "
              f"its `step` line to metrics.jsonl; CPU per report over {n} workers x 10 steps, and per step of all "
              f"{n} (one process handles every report).", "",
              "| decode, us | metrics line, us | controller, us | a report, us | a step's reports, ms |",
              "|---:|---:|---:|---:|---:|",
              f"| {path['decode_us']:.1f} | {path['event_us']:.1f} | {controller_us:.1f} | {path['total_us']:.1f} | "
              f"{path['total_us'] * n / 1000:.3g} |"]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
