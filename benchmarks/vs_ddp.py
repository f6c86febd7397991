#!/usr/bin/env python
"""omnips against torch DistributedDataParallel on emulated heterogeneous workers.

Each workload trains, for each cluster of relative speeds (4:2:1 on 3 workers; HL8,
6:6:4:32 on 4), to the same number of epochs as

* (a) ddp-equal: DDP (gloo, 127.0.0.1) with equal per-rank batches;
* (b) ddp-ideal: DDP with the ideal hand-set per-rank batches, the equal-time plan
  from the known emulated speeds (omnips.batching.equal_time, then integerize given
  the same lines: the plan the omnips controller would compute from exact time models);
* (c) omnips: BSP, --batching dynamic (affine controller), every worker declaring
  the same --capacity: no knowledge of the speeds. 1 server for digits, 2 for the
  large model (through one server process its 25 MB per worker and direction cost
  twice DDP's allreduce here: 145 against 76 ms per step at 4:2:1 in a trial run).

Workloads: the default mlp on digits, and an mlp with hidden (2048, 2048) on
`synthetic` with 1024 features (6.3 M parameters, 25 MB of gradient each way per
step). Same model (omnips.models.build, same seed), same samples (the BSP sample
stream of omnips/data.py: rank i takes its slice of step t's global batch), same
SGD (lr 0.05, momentum 0.9; DDP ranks update with omnips.optim.SGD, torch.optim.SGD
bit for bit) and global batch B in all three. The two DDP variants run one after
the other in one set of rank processes.

Emulation, identical in all three: worker/emulation.py's Emulation with
ms_per_step A and ms_per_sample C per workload and slowdown F = fastest speed /
speed (so the fastest worker runs the virtual device as is): a step's compute
phase lasts max(real, F*(A + C*b)) ms. omnips workers get it as --slowdown,
--emulate-ms-per-step and --emulate-ms-per-sample; a DDP rank pads in a DDP
communication hook, before its allreduce. DDP's bucket is made larger than the
model, so that hook runs once per step, after the whole backward pass: the compute
phase ends there, as in an omnips worker (which pushes after its backward); DDP's
overlap of allreduce with backward buys at most a real backward per step here.
With unequal batches DDP's mean over ranks is unweighted, so each rank's loss is
scaled by b_i*N/B: the averaged gradient is the mean over the global batch, as
in omnips (the factor is 1 for equal batches).

Time to E epochs (wall): first step's start to last step's end (omnips:
summary.json wall_s, from the scheduler's reports, which starts at its first probe
pass (the timed passes that plan its first step, before step 0) and has its
per-epoch evaluations running alongside; DDP: monotonic clock, after a barrier, to the end of the last
optimizer step, evaluated afterwards). samples/s = steps * B / wall.

    python benchmarks/vs_ddp.py [--quick] [--only digits,large] [--speeds 4:2:1,HL8] [--epochs-scale 1]

Prints a line per run and the tables; writes benchmarks/results/vs_ddp.md.
"""

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from ddp_ranks import run_ddp  # noqa: E402
from jobs import run_job  # noqa: E402
from report import machine_lines, publish, runs_dir  # noqa: E402

from omnips import data, models  # noqa: E402
from omnips.batching import equal_time, initial_batches, integerize  # noqa: E402
from omnips.job import JobSpec  # noqa: E402
from omnips.launch import WorkerSpec  # noqa: E402

LR, MOMENTUM, SEED = 0.05, 0.9, 0
JOB_TIMEOUT_S = 600
SPEEDS = {"4:2:1": (4, 2, 1), "HL8": (6, 6, 4, 32)}
VARIANTS = ("ddp-equal", "ddp-ideal", "omnips")
TARGET_VS_EQUAL = 2.0  # (c)/(a) at 4:2:1
TARGET_VS_IDEAL = 1.0  # (c)/(b)


@dataclass(frozen=True)
class Workload:
    name: str
    model_args: dict
    dataset: str
    dataset_args: dict
    global_batch: int
    epochs: float
    ms_per_step: float  # A of the virtual device
    ms_per_sample: float  # C
    servers: int  # omnips servers: the large model's 25 MB through one server process is its bottleneck

    def job(self) -> JobSpec:
        return JobSpec(model="mlp", model_args=self.model_args, dataset=self.dataset, dataset_args=self.dataset_args,
                       global_batch=self.global_batch, epochs=self.epochs, lr=LR, momentum=MOMENTUM, seed=SEED)


WORKLOADS = {
    "digits": Workload("digits", {}, "digits", {}, 128, 10, 10.0, 1.0, 1),
    "large": Workload("large", {"hidden": [2048, 2048]}, "synthetic", {"n": 2048, "features": 1024}, 128, 3,
                      60.0, 6.0, 2),
}


def slowdowns(speeds) -> list[float]:
    return [max(speeds) / s for s in speeds]


def ideal_batches(w: Workload, speeds) -> list[int]:
    """The equal-time plan from the exact virtual devices (b's hand-set batches)."""
    lines = [(f * w.ms_per_step, f * w.ms_per_sample) for f in slowdowns(speeds)]
    return integerize(equal_time(lines, w.global_batch, 1, w.global_batch), w.global_batch, 1, w.global_batch, lines)


def emulated_ms(w: Workload, speeds, batches) -> float:
    """The slowest worker's emulated compute phase under `batches`."""
    return max(f * (w.ms_per_step + w.ms_per_sample * b) for f, b in zip(slowdowns(speeds), batches))


# -- omnips -------------------------------------------------------------------------
def run_omnips(w: Workload, speeds, root: Path, name: str, args) -> dict:
    job = w.job()
    sched = ["--mode", "bsp", "--model", job.model, "--model-args", json.dumps(job.model_args),
             "--dataset", job.dataset, "--dataset-args", json.dumps(job.dataset_args),
             "--global-batch", str(job.global_batch), "--epochs", f"{job.epochs:g}", "--lr", f"{job.lr:g}",
             "--momentum", f"{job.momentum:g}", "--seed", str(job.seed), "--batching", "dynamic",
             "--controller", "affine", "--adjust-every", str(args.adjust_every)]
    workers = [WorkerSpec(capacity=1.0, slowdown=f"{f:.6g}", ms_per_step=w.ms_per_step,
                          ms_per_sample=w.ms_per_sample) for f in slowdowns(speeds)]
    run_dir = root / name
    summary, events = run_job(run_dir, sched, w.servers, workers, name, JOB_TIMEOUT_S)
    steps: dict[int, list[dict]] = {}
    for e in events:
        if e["event"] == "step":
            steps.setdefault(e["step"], []).append(e)
    final = summary["final_batches"]
    # the probe passes before step 0 count in wall_s: from the earliest probe's start to step 0's
    probes = [e["t"] - sum(e["seconds"]) for e in events if e["event"] == "probe"]
    step0 = min(e["t"] - e["compute_s"] - e["network_s"] - e["wait_s"] for e in steps[0])
    return {"wall_s": summary["wall_s"], "steps": summary["steps"], "batches": final,
            "start_s": max(0.0, step0 - min(probes)) if probes else 0.0,
            "compute_s": sum(max(e["compute_s"] for e in es) for es in steps.values()),
            "accuracy": summary["final_test_accuracy"], "loss": summary["final_test_loss"],
            "adjustments": summary["adjustments"], "steady": steady_step_s(steps, final)}


def steady_step_s(steps: dict[int, list[dict]], final: list[int]) -> tuple[int, float] | None:
    """(steps, seconds per step) of the run's tail at its final plan, from the end of the
    step before it (the scheduler's report times); None when the tail has no step before it."""
    last = max(steps)
    first = last + 1
    while first - 1 in steps and [e["batch"] for e in sorted(steps[first - 1], key=lambda e: e["worker"])] == final:
        first -= 1
    if first > last or first - 1 not in steps:
        return None
    end = {s: max(e["t"] for e in steps[s]) for s in (first - 1, last)}
    return last - first + 1, (end[last] - end[first - 1]) / (last - first + 1)


# -- the comparison ------------------------------------------------------------------
def compare(w: Workload, level: str, root: Path, args) -> list[dict]:
    speeds = SPEEDS[level]
    train, _ = data.load(w.dataset, w.dataset_args)
    steps = w.job().total_steps(len(train))
    plans = {"ddp-equal": initial_batches("uniform", w.global_batch, [1.0] * len(speeds)),
             "ddp-ideal": ideal_batches(w, speeds)}
    name = f"{w.name}-{level.replace(':', '')}"
    t0 = time.monotonic()
    ddp = [v for v in args.variants if v in plans]
    runs = dict(zip(ddp, run_ddp(w, slowdowns(speeds), [plans[v] for v in ddp], steps, root / f"{name}-ddp",
                                     JOB_TIMEOUT_S) if ddp else []))
    if "omnips" in args.variants:
        runs["omnips"] = run_omnips(w, speeds, root, f"{name}-omnips", args)
    rows = []
    for variant in args.variants:
        r = runs[variant]
        if r["steps"] != steps:
            raise SystemExit(f"{name} {variant}: {r['steps']} steps, expected {steps}")
        r.update(workload=w.name, level=level, variant=variant, samples_per_s=steps * w.global_batch / r["wall_s"])
        rows.append(r)
        print(f"{w.name:6s} {level:5s} {variant:9s} wall {r['wall_s']:6.2f} s  {r['samples_per_s']:6.0f} samples/s  "
              f"batches {'/'.join(map(str, r['batches']))}  acc {r['accuracy']:.3f}", flush=True)
    print(f"({time.monotonic() - t0:.0f} s with start-up)", flush=True)
    return rows


def target_line(workload: str, level: str, ratio: str, measured: float, target: float | None) -> str:
    """Three decimals: a ratio that rounds to 1.00 may still miss its target."""
    if target is None:
        return f"| {workload} | {level} | {ratio} | (none) | {measured:.3f} | - |"
    verdict = "met" if measured >= target else "missed"
    return f"| {workload} | {level} | {ratio} | >= {target:g} | {measured:.3f} | {verdict} |"


def render(rows: list[dict], workloads: list[Workload], levels: list[str], args, total_s: float,
           params: dict) -> list[str]:
    load = os.getloadavg()
    by = {(r["workload"], r["level"], r["variant"]): r for r in rows}
    lines = [
        "# omnips against torch DistributedDataParallel, emulated heterogeneous workers", "",
        *machine_lines(),
        f"- torch {torch.__version__}; load average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
        "(other work on these cores adds noise)",
        f"- command: `python benchmarks/vs_ddp.py {' '.join(sys.argv[1:])}` ({total_s:.0f} s in all)",
        "- (a) ddp-equal: DDP, gloo on 127.0.0.1, equal per-rank batches; (b) ddp-ideal: DDP with the equal-time "
        "batches from the known emulated speeds; (c) omnips: BSP, --batching dynamic --controller affine "
        f"--adjust-every {args.adjust_every}, every worker --capacity 1 (speeds not told)",
        "- all: 1 torch thread per process, sgd lr 0.05 momentum 0.9, seed 0, the same model, samples and global "
        "batch; DDP ranks scale their loss by b_i*N/B (the averaged gradient is the global batch mean); DDP "
        "with one gradient bucket, its compute phase padded in a communication hook before the allreduce",
        "- emulation: a step's compute phase lasts max(real, F*(A + C*b)) ms, F = fastest speed / the worker's "
        "speed (worker/emulation.py, in every worker and rank)",
        "- speeds: " + ", ".join(f"{k} = {':'.join(map(str, v))} (F {'/'.join(f'{f:.3g}' for f in slowdowns(v))})"
                                 for k, v in SPEEDS.items() if k in levels),
    ]
    for w in workloads:
        lines.append(f"- {w.name}: mlp {json.dumps(w.model_args) if w.model_args else '(hidden (128, 64))'} on "
                     f"{w.dataset}{' ' + json.dumps(w.dataset_args) if w.dataset_args else ''} "
                     f"({params[w.name]:,} parameters), B = {w.global_batch}, "
                     f"{w.epochs:g} epochs; A = {w.ms_per_step:g} ms, C = {w.ms_per_sample:g} ms; "
                     f"omnips with {w.servers} server(s)")
    lines += ["", "Definitions: wall = time to the epochs, the first step's start (omnips: its first probe "
              "pass's) to the last step's end; "
              "samples/s = steps*B/wall; step ms = wall/steps; compute ms = the slowest worker's compute phase "
              "per step (mean over steps); overhead ms = step ms - compute ms (communication, barrier, "
              "the optimizer step, host noise); test acc and loss on the held-out split after the last step (the three "
              "variants train the same model on the same samples: they differ by float rounding only).", "",
              "## Results", "",
              "| workload | speeds | variant | batches (final) | steps | wall s | samples/s | step ms | compute ms | "
              "overhead ms | test acc | test loss |",
              "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s = r["steps"]
        lines.append(f"| {r['workload']} | {r['level']} | {r['variant']} | {'/'.join(map(str, r['batches']))} | {s} | "
                     f"{r['wall_s']:.2f} | {r['samples_per_s']:.0f} | {1000 * r['wall_s'] / s:.1f} | "
                     f"{1000 * r['compute_s'] / s:.1f} | {1000 * (r['wall_s'] - r['compute_s']) / s:.1f} | "
                     f"{r['accuracy']:.4f} | {r['loss']:.5f} |")
    lines += ["", "## Targets", "",
              "| workload | speeds | ratio | target | measured | verdict |", "|---|---|---|---|---:|---|"]
    for w in workloads:
        for level in levels:
            a, b, c = (by.get((w.name, level, v)) for v in VARIANTS)
            if c and a:  # each ratio whose two variants ran (--variants may leave one out)
                target = TARGET_VS_EQUAL if level == "4:2:1" else None
                lines.append(target_line(w.name, level, "(c)/(a)", c["samples_per_s"] / a["samples_per_s"], target))
            if c and b:
                lines.append(target_line(w.name, level, "(c)/(b)", c["samples_per_s"] / b["samples_per_s"],
                                         TARGET_VS_IDEAL))
    lines += ["", "## Where (c) and (b) differ", "",
              "wall = start + sum of the slowest compute phases + steps x overhead, so wall(c) - wall(b) splits "
              "exactly into start (omnips's probe passes before step 0, 2 and 4 samples on every emulated device; "
              "DDP is told its batches), balancing (the slowest compute phases of (c) beyond (b)'s: steps before the "
              "controller reached its plan, and any difference between its plan and (b)'s) and overhead "
              "(communication and the rest). The bound: equal batches take U = max_i F_i(A + C*B/N) per step, the "
              "ideal plan T. At its final plan: (c)'s tail of steps at the batches it ended with, timed from the end "
              "of the step before it (from step 0's start when the plan never changed), against (b)'s step ms over "
              "the whole run.", "",
              "| workload | speeds | U ms | T ms | U/T | wall (c) - (b) s | start s | balancing s | overhead s | "
              "overhead ms/step (b) / (c) | adjustments (c) | (c) at its final plan: steps, step ms, (c)/(b) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for w in workloads:
        for level in levels:
            b, c = by.get((w.name, level, "ddp-ideal")), by.get((w.name, level, "omnips"))
            if not (b and c):
                continue
            speeds = SPEEDS[level]
            u = emulated_ms(w, speeds, initial_batches("uniform", w.global_batch, [1.0] * len(speeds)))
            t = emulated_ms(w, speeds, ideal_batches(w, speeds))
            start = c["start_s"]
            ob, oc = b["wall_s"] - b["compute_s"], c["wall_s"] - c["compute_s"] - start
            tail = "-"
            steady = c["steady"] or (None if c["adjustments"] else (c["steps"], (c["wall_s"] - start) / c["steps"]))
            if steady:
                n, per = steady
                tail = f"{n}, {1000 * per:.1f}, {b['wall_s'] / b['steps'] / per:.3f}"
            lines.append(f"| {w.name} | {level} | {u:.1f} | {t:.1f} | {u / t:.2f} | {c['wall_s'] - b['wall_s']:.2f} | "
                         f"{start:.2f} | {c['compute_s'] - b['compute_s']:.2f} | {oc - ob:.2f} | "
                         f"{1000 * ob / b['steps']:.1f} / {1000 * oc / c['steps']:.1f} | {c['adjustments']} | {tail} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads (digits,large)")
    p.add_argument("--speeds", default=",".join(SPEEDS), help="comma-separated speed sets (4:2:1,HL8)")
    p.add_argument("--epochs-scale", type=float, default=1.0, help="multiply every workload's epochs")
    p.add_argument("--adjust-every", type=int, default=5, help="omnips --adjust-every")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants to run")
    p.add_argument("--quick", action="store_true", help="smoke run: digits at 4:2:1 for 1 epoch")
    p.add_argument("--out", type=Path, default=HERE / "results" / "vs_ddp.md")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    levels = [s.strip() for s in args.speeds.split(",") if s.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.quick:
        names, levels, args.epochs_scale = ["digits"], ["4:2:1"], 1 / WORKLOADS["digits"].epochs
    unknown = ([n for n in names if n not in WORKLOADS] + [s for s in levels if s not in SPEEDS]
               + [v for v in args.variants if v not in VARIANTS])
    if unknown or not names or not levels or not args.variants:
        p.error(f"unknown or no workload, speeds or variant: {', '.join(unknown) or '(none given)'}")
    if not args.epochs_scale > 0 or not math.isfinite(args.epochs_scale):
        p.error("--epochs-scale must be a positive number")
    workloads = [replace(WORKLOADS[n], epochs=WORKLOADS[n].epochs * args.epochs_scale) for n in names]
    params = {}
    for w in workloads:
        train, _ = data.load(w.dataset, w.dataset_args)
        params[w.name] = sum(t.numel() for t in models.build("mlp", w.model_args, train, SEED).parameters())
        print(f"{w.name}: {params[w.name]:,} parameters, {len(train)} training samples, "
              f"{w.job().total_steps(len(train))} steps", flush=True)
    start, rows = time.monotonic(), []
    with runs_dir("omnips-vs-ddp-") as root:
        for w in workloads:
            for level in levels:
                rows += compare(w, level, root, args)
    publish(render(rows, workloads, levels, args, time.monotonic() - start, params), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
