#!/usr/bin/env python
"""Does an asynchronous job train with a BSP recipe? Accuracy of BSP, ASP and SSP.

Every run is a real job (scheduler, 2 servers, N workers as processes) on digits with
the same recipe, --global-batch 96, --epochs E, and one of
  sgd: --lr 0.1 --momentum 0.9 (nesterov: and --nesterov);   adam: --optimizer adam --lr 0.003.
It changes only the mode (bsp; asp; ssp with --staleness 2), the asynchronous
correction (--async-correction, server/asynchrony.py), the batching (uniform or
dynamic) and the workers' speeds.

Speeds are emulated: worker i's compute phase lasts F_i * (A + C * batch) ms
(--emulate-ms-per-step A, --emulate-ms-per-sample C), F_i = k^(i / (N - 1)) at level
HLk (the fastest worker k times faster than the slowest; HL1 all equal).

From each run: the final test accuracy; the wall time from the first training step to
the first evaluation (one per epoch) at 90 % and at 95 % test accuracy; the staleness
mean and maximum (summary.json); whether the scheduler found it diverged.

Sections (each a list of runs; --sections picks some):
  corrections  mlp, N = 3 and 8, HL1, uniform, sgd: BSP, ASP with every correction,
               SSP with the default and with none;
  adam         the same with Adam: BSP, ASP and SSP with the default, ASP with none;
  nesterov     the same with SGD --nesterov: BSP, ASP and SSP with the default;
  speeds       mlp, N = 3 at HL1, HL4, HL8 and N = 8 at HL8: BSP, ASP, SSP (default
               correction), uniform and dynamic batching;
  cnn          cnn, N = 3, HL1, uniform: BSP, ASP, SSP (default correction);
  cost         no job: what each correction adds to a server's update of an 11 M-value
               shard (ShardCore.handle of an ASP push, in process, interleaved).
--full runs what each section names over the issue's whole grid instead (both
models, N = 3 and 8, HL1/HL4/HL8, both batchings, every correction): many hours here.

    python benchmarks/asp_accuracy.py [--sections corrections,speeds] [--seeds 0,1,2] [--epochs 8]
        [--quick] [--full] [--out benchmarks/results/asp_accuracy.md]

Prints a line per run and the tables; writes the results file and a plot of test
accuracy against wall time beside it (.png).
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from jobs import run_job  # noqa: E402
from report import machine_lines, publish, runs_dir  # noqa: E402

from omnips.job import ASYNC_CORRECTIONS, JobSpec  # noqa: E402
from omnips.launch import WorkerSpec  # noqa: E402

DEFAULT = JobSpec.async_correction
RECIPES = {"sgd": ["--lr", "0.1", "--momentum", "0.9"], "nesterov": ["--lr", "0.1", "--momentum", "0.9", "--nesterov"],
           "adam": ["--optimizer", "adam", "--lr", "0.003"]}
LEVELS = {"HL1": 1, "HL4": 4, "HL8": 8}
MS_PER_STEP, MS_PER_SAMPLE = 1.0, 0.25
JOB_TIMEOUT_S = 600


@dataclass(frozen=True)
class Run:
    section: str
    model: str
    workers: int
    level: str
    batching: str
    mode: str
    correction: str  # "-" for BSP
    optimizer: str = "sgd"

    def key(self) -> tuple:
        return (self.model, self.workers, self.level, self.batching, self.optimizer, self.mode, self.correction)

    def label(self) -> str:
        return (f"{self.model} N={self.workers} {self.level} {self.batching} {self.optimizer} {self.mode}"
                + (f" {self.correction}" if self.mode != "bsp" else ""))


def section_runs(name: str, full: bool, corrections=ASYNC_CORRECTIONS, speeds=tuple(LEVELS)) -> list[Run]:
    models = ["mlp", "cnn"] if full else ["cnn" if name == "cnn" else "mlp"]
    workers = [3, 8] if full or name in ("corrections", "adam", "nesterov", "speeds") else [3]
    levels = list(LEVELS) if full else list(speeds) if name == "speeds" else ["HL1"]
    batchings = ["uniform", "dynamic"] if full or name == "speeds" else ["uniform"]
    optimizer = {"adam": "adam", "nesterov": "nesterov"}.get(name, "sgd")
    if full or name == "corrections":
        asynchronous = [("asp", c) for c in corrections] + [("ssp", c) for c in corrections
                                                             if full or c in (DEFAULT, "none")]
    elif name == "adam":
        asynchronous = [("asp", DEFAULT), ("asp", "none"), ("ssp", DEFAULT)]
    else:
        asynchronous = [("asp", DEFAULT), ("ssp", DEFAULT)]
    return [Run(name, m, n, lv, b, mode, c, optimizer)
            for m in models for n in workers for lv in levels for b in batchings
            if full or name != "speeds" or n == 3 or lv == "HL8"  # 8 workers: the slowest level only
            for mode, c in [("bsp", "-"), *asynchronous]]


def scheduler_args(run: Run, seed: int, epochs: float) -> list[str]:
    # --nan-policy skip: a run whose updates overflow still ends, and says it diverged
    args = ["--mode", run.mode, "--model", run.model, "--dataset", "digits", "--global-batch", "96",
            "--epochs", f"{epochs:g}", "--seed", str(seed), "--batching", run.batching, "--nan-policy", "skip",
            *RECIPES[run.optimizer]]
    if run.mode != "bsp":
        args += ["--async-correction", run.correction]
    if run.mode == "ssp":
        args += ["--staleness", "2"]
    return args


def worker_specs(run: Run) -> list[WorkerSpec]:
    k, n = LEVELS[run.level], run.workers
    return [WorkerSpec(slowdown=f"{k ** (i / (n - 1)):.6g}", ms_per_step=MS_PER_STEP, ms_per_sample=MS_PER_SAMPLE)
            for i in range(n)]


def measure(root: Path, run: Run, seed: int, epochs: float) -> dict:
    run_dir = root / f"{run.label().replace(' ', '_')}-s{seed}"
    t0 = time.monotonic()
    try:
        summary, events = run_job(run_dir, scheduler_args(run, seed, epochs), 2, worker_specs(run),
                                  f"{run.label()} seed {seed}", JOB_TIMEOUT_S)
    except SystemExit as exc:  # one failed job is a row of the table, not the end of the benchmark
        print(exc, file=sys.stderr)
        return {"acc": None, "curve": [], "wall_s": None, "to90": None, "to95": None, "stale_mean": None,
                "stale_max": None, "diverged": False, "failed": True, "elapsed_s": time.monotonic() - t0}
    first = min(e["t"] - e["compute_s"] - e["network_s"] - e["wait_s"] for e in events if e["event"] == "step")
    curve = [(e["t"] - first, e["test_accuracy"]) for e in events if e["event"] == "eval"]
    return {"acc": summary["final_test_accuracy"], "curve": curve, "wall_s": summary["wall_s"], "failed": False,
            "to90": next((t for t, a in curve if a >= 0.90), None),
            "to95": next((t for t, a in curve if a >= 0.95), None),
            "stale_mean": summary["staleness_mean"], "stale_max": summary["staleness_max"],
            "diverged": summary.get("diverged", False), "elapsed_s": time.monotonic() - t0}


# -- tables ------------------------------------------------------------------------
def fmt_range(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = statistics.mean(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def times(rows: list[dict], key: str) -> str:
    reached = [r[key] for r in rows if r[key] is not None]
    if not reached:
        return "never"
    share = f" ({len(reached)} of {len(rows)})" if len(reached) < len(rows) else ""
    return f"{statistics.mean(reached):.1f} s{share}"


def points(acc: list[float], bsp: list[float]) -> str:
    """The mean difference from BSP's accuracy in points, ± its standard error over the seeds,
    paired by seed (one seed's final evaluation moves by points: 360 test samples)."""
    diffs = [100 * (a - b) for a, b in zip(acc, bsp)]
    se = f" ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.1f}" if len(diffs) > 1 else ""
    return f"{statistics.mean(diffs):+.1f}{se}"


def table(results: dict, runs: list[Run], seeds: list[int]) -> list[str]:
    lines = ["| model | N | speeds | batching | optimizer | mode | correction | final test accuracy, mean (min-max) "
             "| - BSP's (points, ± standard error) | time to 90 % | time to 95 % | staleness mean / max | diverged |",
             "|---|---:|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        rows = [results[(run.key(), s)] for s in seeds]
        bsp = [results[(replace(run, mode="bsp", correction="-").key(), s)]["acc"] for s in seeds]
        acc = [r["acc"] for r in rows]
        delta = "" if run.mode == "bsp" or None in acc + bsp else points(acc, bsp)
        ran = [r for r in rows if not r["failed"]]
        stale = "" if run.mode == "bsp" or not ran else \
            f"{statistics.mean(r['stale_mean'] for r in ran):.2f} / {max(r['stale_max'] for r in ran)}"
        failed = sum(r["failed"] for r in rows)
        verdicts = f"{sum(r['diverged'] for r in rows)} of {len(rows)}" + (f", {failed} failed" if failed else "")
        lines.append(f"| {run.model} | {run.workers} | {run.level} | {run.batching} | {run.optimizer} | {run.mode} "
                     f"| {run.correction} | {fmt_range(acc)} | {delta} | {times(rows, 'to90')} "
                     f"| {times(rows, 'to95')} | {stale} | {verdicts} |")
    return lines


def plot(results: dict, runs: list[Run], seed: int, out: Path) -> str | None:
    """Test accuracy against wall time for the slowest level's runs of `seed`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speeds = [r for r in runs if r.section == "speeds"]
    if not speeds:
        return None
    level = max((r.level for r in speeds), key=LEVELS.get)
    counts = sorted({r.workers for r in speeds if r.level == level})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.5), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for run in (r for r in speeds if r.level == level and r.workers == n):
            curve = results[(run.key(), seed)]["curve"]
            ax.plot([t for t, _ in curve], [a for _, a in curve], marker="o", ms=3,
                    linestyle="-" if run.batching == "dynamic" else "--", label=f"{run.mode} {run.batching}")
        ax.axhline(0.95, color="grey", lw=0.8)
        ax.set_xlabel("wall time from the first step (s)")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
        ax.set_title(f"digits mlp, {n} workers at {level}, seed {seed}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out.name


def update_cost(n: int, rounds: int) -> list[str]:
    """What each correction adds to a server's update: ShardCore.handle of an ASP push of
    `n` values (finiteness check, step, reply) from 3 workers taking turns, staleness 2,
    one torch thread as the servers run; the corrections in turn, round after round."""
    import numpy as np
    import torch

    from omnips.job import JobSpec
    from omnips.protocol import Init, Push
    from omnips.server.shard import ShardCore

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    params, grads = rng.standard_normal(n).astype(np.float32), 1e-3 * rng.standard_normal(n).astype(np.float32)
    cores, pushes = {}, {}
    for name in ASYNC_CORRECTIONS:
        job = JobSpec(mode="asp", num_workers=3, global_batch=96, dataset="synthetic", max_steps=10 ** 6,
                      async_correction=name)
        cores[name] = ShardCore(job, 0, n, n)
        cores[name].handle(b"w0", Init(rank=0, data=params), 0.0)
        pushes[name] = 0

    def push(name):
        core, k = cores[name], pushes[name]
        rank = k % 3
        core.handle(b"w%d" % rank, Push(rank=rank, step=k // 3, version=max(0, core.version - 2), batch=32, gen=0,
                                         data=grads), 0.0)
        pushes[name] += 1

    times = {name: [] for name in ASYNC_CORRECTIONS}
    for r in range(rounds + 3):  # 3 rounds of warm-up: every worker's first reply recorded
        for name in ASYNC_CORRECTIONS:
            t = time.perf_counter()
            push(name)
            if r >= 3:
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["none"])
    lines = [f"{n / 1e6:g} M values, {rounds} rounds, corrections interleaved; median of each",
             "", "| correction | update (check + step + reply) | x none | memory: shard-sized buffers added |",
             "|---|---:|---:|---:|"]
    extra = {"none": "0", "momentum": "0", "dana": "1 per worker", "lookahead": "1", "dc": "1 + 1 per worker",
             "gap": "3 + 1 per worker"}
    for name in ASYNC_CORRECTIONS:
        med = statistics.median(times[name])
        lines.append(f"| {name} | {1000 * med:.1f} ms | {med / base:.3f} | {extra[name]} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--sections", default="corrections,adam,nesterov,speeds,cnn,cost")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=float, default=8.0)
    p.add_argument("--full", action="store_true", help="the whole grid in every section named")
    p.add_argument("--corrections", default=",".join(ASYNC_CORRECTIONS),
                   help="the corrections section's (default: every one)")
    p.add_argument("--levels", default=",".join(LEVELS), help="the speeds section's (default: every one)")
    p.add_argument("--quick", action="store_true", help="toy size: 1 epoch, seed 0, a run of each kind")
    p.add_argument("--out", type=Path, default=HERE / "results" / "asp_accuracy.md")
    p.add_argument("--keep-runs", action="store_true")
    p.add_argument("--cost-values", type=int, default=11_000_000, help="shard size of the update-cost table")
    p.add_argument("--cost-rounds", type=int, default=30)
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    corrections, levels = args.corrections.split(","), args.levels.split(",")
    for flag, names, known in (("--corrections", corrections, ASYNC_CORRECTIONS), ("--levels", levels, LEVELS)):
        if set(names) - set(known):
            p.error(f"unknown {flag} {', '.join(sorted(set(names) - set(known)))} (known: {', '.join(known)})")
    runs = [r for name in args.sections.split(",") if name != "cost"
            for r in section_runs(name, args.full, corrections, levels)]
    if args.quick:
        seeds, args.epochs = [0], 1.0
        runs = [r for r in runs if r.mode == "bsp" or r.correction in (DEFAULT, "none")][:4]
    results = {}
    t0 = time.monotonic()
    with runs_dir("omnips-asp-", keep=args.keep_runs) as root:
        for run in runs:
            for seed in seeds:
                if (run.key(), seed) in results:  # a BSP run two sections share
                    continue
                r = results[(run.key(), seed)] = measure(root, run, seed, args.epochs)
                print(f"{run.label()} seed {seed}: " + ("failed" if r["failed"] else
                      f"accuracy {r['acc']:.4f}, to 95 % {r['to95']}, "
                      f"staleness {r['stale_mean']:.2f}/{r['stale_max']}, "
                      f"diverged {r['diverged']}") + f" ({r['elapsed_s']:.0f} s)", flush=True)
    lines = ["# Asynchronous training with a BSP recipe: benchmarks/asp_accuracy.py", "", *machine_lines(),
             f"- command: python benchmarks/asp_accuracy.py {' '.join(sys.argv[1:])}",
             f"- {len(results)} jobs in {(time.monotonic() - t0) / 60:.0f} min; seeds {', '.join(map(str, seeds))}; "
             f"{args.epochs:g} epochs; default correction: {DEFAULT}",
             f"- recipes: {'; '.join(f'{name} ' + ' '.join(flags) for name, flags in RECIPES.items())}; "
             "--global-batch 96, "
             "2 servers; SSP --staleness 2",
             f"- emulated speeds: F_i * ({MS_PER_STEP:g} + {MS_PER_SAMPLE:g} * batch) ms a step, "
             "F_i = k^(i/(N-1)) at HLk", ""]
    for name in dict.fromkeys(r.section for r in runs):
        lines += [f"## {name}", "", *table(results, [r for r in runs if r.section == name], seeds), ""]
    if "cost" in args.sections.split(","):
        lines += ["## cost", "", *update_cost(args.cost_values, 3 if args.quick else args.cost_rounds), ""]
    picture = plot(results, runs, seeds[0], args.out.with_suffix(".png"))
    if picture:
        lines += [f"![test accuracy against wall time]({picture})", ""]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
