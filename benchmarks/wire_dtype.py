#!/usr/bin/env python
"""--wire-dtype float32 vs bfloat16 vs float16: accuracy on digits, bytes and push+pull time.

* Accuracy: the same BSP job (digits, mlp, 2 workers and 1 server as processes,
  --global-batch 64, --lr 0.05, --momentum 0.9, --epochs E) for each wire dtype and
  each seed; final test accuracy and loss from the run's summary.json.
* Bytes: the encoded frames of one Push and one Params of a --params vector.
* Time: for that vector (an mlp on synthetic data sized as in pushpull.py), one real
  scheduler and server per wire dtype (BSP, this process as the only worker), all up at
  once; round trips rotate between them, so each ratio to float32 compares the same
  seconds on this noisy machine. A round trip is what a worker does per step: narrow
  the gradient, ServerGroup.push_pull (the server widens, checks, steps and narrows its
  reply), widen the reply into the parameters. This process runs one torch thread, as
  the launcher's workers and the servers here do.

Every process runs with transport.MALLOC_ENV (this one through tune_malloc()).

    python benchmarks/wire_dtype.py [--epochs 10] [--seeds 0,1] [--params 11000000] [--repeats 20]

Prints the tables and writes benchmarks/results/wire_dtype.md.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from omnips import transport  # noqa: E402

transport.tune_malloc()  # before the first large allocation

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq  # noqa: E402

from omnips import codec  # noqa: E402
from omnips.flat import aligned_empty  # noqa: E402
from omnips.job import WIRE_DTYPES  # noqa: E402
from omnips.launch import WorkerSpec  # noqa: E402
from omnips.protocol import Params, Push  # noqa: E402
from omnips.wire import WireDtype  # noqa: E402
from pushpull import job_args, median_time, model_size  # noqa: E402
from jobs import run_job  # noqa: E402
from report import machine_lines, publish, runs_dir  # noqa: E402
from solo import SoloWorker  # noqa: E402

JOB_TIMEOUT_S = 300.0
DIGITS = ["--mode", "bsp", "--dataset", "digits", "--model", "mlp", "--global-batch", "64", "--lr", "0.05",
          "--momentum", "0.9"]


def accuracy_run(wire: str, seed: int, epochs: float, root: Path) -> dict:
    summary, _ = run_job(root / f"digits-{wire}-{seed}", [*DIGITS, "--epochs", str(epochs), "--seed", str(seed),
                                                          "--wire-dtype", wire], 1, [WorkerSpec(), WorkerSpec()],
                         f"{wire} seed {seed}", JOB_TIMEOUT_S)
    return {"wire": wire, "seed": seed, "acc": summary["final_test_accuracy"], "loss": summary["final_test_loss"],
            "steps": summary["steps"]}


class WireJob:
    """A BSP job of one scheduler and one server in `wire`, this process its only worker,
    reaching the server over tcp loopback."""

    def __init__(self, wire: str, model_args: dict, dataset_args: dict, steps: int, root: Path, ctx: zmq.Context):
        self.wire = WireDtype(wire)
        self.solo = SoloWorker(ctx, root / f"pushpull-{wire}", [
            "--mode", "bsp", "--wire-dtype", wire, "--model", "mlp", "--model-args", json.dumps(model_args),
            "--dataset", "synthetic", "--dataset-args", json.dumps(dataset_args), "--global-batch", "1",
            "--max-steps", str(steps), "--dead-after", "120"], 1, ["--threads", "1"], transport="tcp", wire=self.wire)

    def connect(self, params0: np.ndarray, grads: np.ndarray) -> None:
        self.group = self.solo.start(params0.size)
        self.params = aligned_empty(params0.size)
        self.params[:] = params0
        self.grads, self.buf = grads, self.wire.buffer(grads.size)
        self.group.init(self.params)
        self.group.pull(self.params)

    def round_trip(self) -> float:
        start = time.perf_counter()
        ex = self.group.push_pull(0, self.solo.steps, self.wire.narrow(self.grads, self.buf), 1, 0, self.params)
        took = time.perf_counter() - start
        self.solo.report(ex)
        return took


def time_round_trips(n_target: int, warmup: int, repeats: int, root: Path) -> tuple[int, dict]:
    steps = warmup + repeats
    model_args, dataset_args = job_args(n_target, steps)
    n = model_size(model_args, dataset_args)
    rng = np.random.default_rng(0)
    params0 = rng.standard_normal(n, dtype=np.float32) * 0.01
    grads = aligned_empty(n)
    grads[:] = rng.standard_normal(n, dtype=np.float32) * 1e-4
    ctx = zmq.Context()
    jobs = [WireJob(w, model_args, dataset_args, steps, root, ctx) for w in WIRE_DTYPES]
    try:
        for job in jobs:
            job.connect(params0, grads)
        times = {w: [] for w in WIRE_DTYPES}
        for step in range(steps):
            for job in jobs[step % len(jobs):] + jobs[:step % len(jobs)]:  # rotate who goes first
                took = job.round_trip()
                if step >= warmup:
                    times[job.wire.name].append(took)
        for job in jobs:
            job.solo.finish()
        if not all(np.isfinite(job.params).all() for job in jobs):
            raise RuntimeError("parameters went non-finite")
    finally:
        for job in jobs:
            job.solo.stop()
        ctx.destroy(linger=0)
    return n, times


def wire_bytes(n: int) -> dict:
    """Bytes on the wire for a push and its reply of `n` values (headers included)."""
    values = aligned_empty(n)
    values.fill(1e-3)
    out = {}
    for name in WIRE_DTYPES:
        w = WireDtype(name)
        data = w.narrow(values, w.buffer(n))
        frames = codec.encode(Push(rank=0, step=0, version=0, batch=1, gen=0, data=data))
        frames += codec.encode(Params(step=0, version=1, held_s=0.0, plan=None, data=data))
        out[name] = sum(memoryview(f).nbytes for f in frames)
    return out


def conversion_times(n: int, repeats: int) -> dict:
    """Median seconds to narrow a float32 vector of `n` into a wire buffer and to widen it back."""
    values = aligned_empty(n)
    values[:] = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    back = aligned_empty(n)
    out = {}
    for name in WIRE_DTYPES[1:]:
        w = WireDtype(name)
        buf = w.buffer(n)
        for what, fn in (("narrow", lambda: w.narrow(values, buf)), ("widen", lambda: w.widen(buf, back))):
            fn()
            out[(name, what)] = median_time(fn, repeats)
    return out


def render(acc_rows, n, times, nbytes, conv, args, total_s) -> list[str]:
    lines = ["# Wire dtype: float32 vs bfloat16 vs float16", "", *machine_lines(),
             f"- accuracy: BSP digits, mlp, 2 workers + 1 server (processes), --global-batch 64 --lr 0.05 "
             f"--momentum 0.9 --epochs {args.epochs:g}, seeds {args.seeds}",
             f"- time: {n:,} values ({4 * n / 1e6:.1f} MB as float32), BSP, 1 server (--threads 1), this process the "
             f"worker; {args.repeats} timed round trips per dtype after {args.warmup} warm-ups, rotating between "
             "three clusters up at once; tcp loopback",
             f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
             "", "## Accuracy", "",
             "| wire dtype | seed | steps | final test accuracy | final test loss |", "|---|---:|---:|---:|---:|"]
    for r in acc_rows:
        lines.append(f"| {r['wire']} | {r['seed']} | {r['steps']} | {r['acc']:.4f} | {r['loss']:.4f} |")
    lines += ["", "| wire dtype | mean accuracy | vs float32 | mean loss |", "|---|---:|---:|---:|"]
    mean = {w: statistics.mean(r["acc"] for r in acc_rows if r["wire"] == w) for w in WIRE_DTYPES}
    for w in WIRE_DTYPES:
        loss = statistics.mean(r["loss"] for r in acc_rows if r["wire"] == w)
        lines.append(f"| {w} | {mean[w]:.4f} | {mean[w] - mean['float32']:+.4f} | {loss:.4f} |")
    base = statistics.median(times["float32"])
    lines += ["", "## Bytes and push+pull time", "",
              "| wire dtype | bytes per push + reply | vs float32 | median ms | p10 ms | p90 ms | time vs float32 "
              "| median of per-round ratios |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for w in WIRE_DTYPES:
        t = sorted(times[w])
        p10, p90 = t[len(t) // 10], t[min(len(t) - 1, (9 * len(t)) // 10)]
        paired = statistics.median(a / b for a, b in zip(times[w], times["float32"]))  # the same rotation
        lines.append(f"| {w} | {nbytes[w]:,} | {nbytes[w] / nbytes['float32']:.3f}x | {statistics.median(t) * 1e3:.1f} "
                     f"| {p10 * 1e3:.1f} | {p90 * 1e3:.1f} | {statistics.median(t) / base:.2f}x | {paired:.2f}x |")
    lines += ["", "Conversions in this process (medians, 1 torch thread), part of each round trip above: the "
              "worker narrows its gradient and widens the reply, the server widens the push and narrows the reply.",
              "", "| wire dtype | narrow ms | widen ms |", "|---|---:|---:|"]
    for w in WIRE_DTYPES[1:]:
        lines.append(f"| {w} | {conv[(w, 'narrow')] * 1e3:.2f} | {conv[(w, 'widen')] * 1e3:.2f} |")
    lines += ["", f"Total benchmark time: {total_s:.0f} s."]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=float, default=10.0, help="epochs of each digits run")
    p.add_argument("--seeds", default="0,1", help="comma-separated job seeds for the digits runs")
    p.add_argument("--params", type=int, default=11_000_000, help="values per push (approximate: the mlp's size)")
    p.add_argument("--repeats", type=int, default=30, help="timed round trips per wire dtype")
    p.add_argument("--warmup", type=int, default=3, help="untimed round trips first")
    p.add_argument("--out", default=str(HERE / "results" / "wire_dtype.md"))
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories and logs")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    if args.repeats < 1 or args.warmup < 0 or args.params < 1000 or not args.epochs > 0:
        p.error("need --repeats >= 1, --warmup >= 0, --params >= 1000, --epochs > 0")

    torch.set_num_threads(1)  # as a launched worker (--threads 1): conversions are torch copies
    start = time.monotonic()
    with runs_dir("omnips-wire-", args.keep_runs) as root:
        acc_rows = []
        for seed in seeds:
            for w in WIRE_DTYPES:
                acc_rows.append(accuracy_run(w, seed, args.epochs, root))
                print(f"  digits {w} seed {seed}: accuracy {acc_rows[-1]['acc']:.4f}", flush=True)
        n, times = time_round_trips(args.params, args.warmup, args.repeats, root)
    lines = render(acc_rows, n, times, wire_bytes(n), conversion_times(n, 7), args, time.monotonic() - start)
    publish(lines, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
