#!/usr/bin/env python
"""Gradient buckets sent while backward runs vs the whole gradient sent after it.

One invocation trains the same BSP job (one worker, one server, a scheduler: real
processes on loopback) with the worker's `--bucket-size` set to each value under
test, in interleaved rounds (A B C A B C ...) so drift on this noisy machine hits
every variant alike. The model is an mlp of --hidden layers on `synthetic` inputs
of --features values, large enough that a push + pull of its gradient is a
visible part of a step. Per run: the median time between the worker's consecutive
step reports (a step's compute, push and pull), after the first --skip steps.

    python benchmarks/overlap.py [--sizes 0,1M,4M,16M] [--rounds 2] [--steps 40]

Prints a table and writes it to benchmarks/results/overlap.md.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish  # noqa: E402

from omnips.flags import size  # noqa: E402
from jobs import run_job  # noqa: E402
from pushpull import model_size  # noqa: E402

from omnips.launch import WorkerSpec  # noqa: E402

JOB_TIMEOUT_S = 600.0


def dataset_args(args) -> dict:
    return {"n": 4096, "features": args.features}


def scheduler_args(args) -> list[str]:
    return ["--mode", "bsp", "--dataset", "synthetic",
            "--dataset-args", json.dumps(dataset_args(args)),
            "--model", "mlp", "--model-args", json.dumps({"hidden": args.hidden}),
            "--global-batch", str(args.batch), "--max-steps", str(args.steps), "--lr", "0.01", "--seed", "0"]


def run_one(root: Path, bucket: str, round_: int, args) -> dict:
    run_dir = root / f"bucket-{bucket}-{round_}"
    worker = WorkerSpec(threads=args.threads, extra=("--bucket-size", bucket))
    _, events = run_job(run_dir, scheduler_args(args), 1, [worker], f"bucket {bucket}", JOB_TIMEOUT_S)
    steps = [e for e in events if e["event"] == "step"]
    times = [e["t"] for e in steps]
    gaps = [b - a for a, b in zip(times, times[1:])][args.skip:]
    server_log = (run_dir / "logs" / "server0.log").read_text()
    if " pushes came in parts" not in server_log:
        raise RuntimeError(f"bucket {bucket}: the server's log has no count of pushes in parts ({run_dir / 'logs'})")
    return {"bucket": bucket, "step_s": statistics.median(gaps),
            "compute_s": statistics.median(e["compute_s"] for e in steps[args.skip:]),
            "network_s": statistics.median(e["network_s"] + e["wait_s"] for e in steps[args.skip:]),
            "parts": server_log.split(" pushes came in parts")[0].rsplit(" ", 1)[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="0,1M,4M,16M", help="--bucket-size values to compare; 0 first (baseline)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="steps left out at the start (warm-up)")
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", type=lambda t: [int(x) for x in t.split(",")], default=[2048, 2048, 1024])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE / "results" / "overlap.md")
    args = p.parse_args(argv)
    sizes = args.sizes.split(",")
    for s in sizes:
        if s != "0":
            size(s)  # a clear error now rather than in the worker
    if sizes[0] != "0":
        p.error("--sizes must start with 0, the baseline")
    start = time.monotonic()
    results: dict[str, list[dict]] = {s: [] for s in sizes}
    with tempfile.TemporaryDirectory(prefix="omnips-overlap-") as tmp:
        for r in range(args.rounds):
            for s in sizes:
                res = run_one(Path(tmp), s, r, args)
                results[s].append(res)
                print(f"round {r} bucket {s}: step {res['step_s'] * 1000:.1f} ms, parts joined {res['parts']}",
                      flush=True)
    values = model_size({"hidden": args.hidden}, dataset_args(args))
    base = [r["step_s"] for r in results["0"]]
    lines = ["# Gradient buckets sent during backward vs the whole gradient after it", "", *machine_lines(),
             f"- job: BSP, 1 worker ({args.threads} torch thread), 1 server, mlp {args.hidden} on synthetic "
             f"({args.features} features): {values:,} values = {values * 4 / 2**20:.1f} MiB each way; "
             f"global batch {args.batch}, {args.steps} steps per run, first {args.skip} left out",
             f"- {args.rounds} interleaved rounds of every variant; per run the median time between the worker's "
             "step reports; ratios against the baseline run of the same round",
             f"- load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", "",
             "| --bucket-size | step ms (median of runs) | compute ms | push+pull wait ms | step / baseline, "
             "per round | parts joined by the server |",
             "|---|---:|---:|---:|---|---:|"]
    for s in sizes:
        runs = results[s]
        ratios = ", ".join(f"{r['step_s'] / b:.3f}" for r, b in zip(runs, base))
        lines.append(f"| {s} | {statistics.median(r['step_s'] for r in runs) * 1000:.1f} | "
                     f"{statistics.median(r['compute_s'] for r in runs) * 1000:.1f} | "
                     f"{statistics.median(r['network_s'] for r in runs) * 1000:.1f} | {ratios} | {runs[0]['parts']} |")
    lines += ["", "compute: the worker's forward + backward, which with buckets includes sending them; push+pull "
              "wait: from the end of backward to the last reply.", "",
              f"Total benchmark time: {time.monotonic() - start:.0f} s."]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
