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

Efficiency, and the levels as speeds: benchmarks/efficiency.py.

Afterwards the schedule is also replayed through the scheduler's controller object
(scheduler/control.py) without processes, for several alignments of its measurement
windows against the speed changes: a live run sees only one of them.

    python benchmarks/heterogeneity.py [--epochs 15] [--schedule-steps 200] [--quick] [--keep-runs]
        [--only HL8,schedule] [--variants uniform,affine] [--ms-per-step 3] [--ms-per-sample 4]

Prints a line per run and the tables; writes benchmarks/results/heterogeneity.md.
"""

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from efficiency import LEVELS, SCHEDULE, Scenario, analyse, factor  # noqa: E402
from heterogeneity_report import render, targets, yes  # noqa: E402
from jobs import run_job  # noqa: E402
from report import code_version, runs_dir  # noqa: E402

from omnips.launch import WorkerSpec  # noqa: E402

VARIANTS = ("uniform", "static", "proportional", "affine")
JOB_TIMEOUT_S = 300


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

    started_at = code_version()
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
    text = render(results, args, time.monotonic() - t0, scenarios, started_at)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print()
    print(text)
    _, verdicts = targets(results, args)
    print("targets: " + ", ".join(f"{name} {yes(ok)}" for name, ok in verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
