#!/usr/bin/env python
"""A CPU worker's step with the C allocator as glibc sets it up, against with the memory a step
frees kept for the next (worker/memory.keep_freed_memory, which every worker now calls).

Each measurement is a fresh process (an allocator is set once, before its first large block):
the worker's own Trainer computes a step's gradient, one torch thread, a few steps to warm up,
then STEPS steps timed. Per batch size, the CPU time a step takes (the process's, the kernel's
page zeroing in it) and the minor page faults it takes, each the median over its steps; the two
arms run in turn, REPEATS times, and the table gives the medians and kept over default. The
model is benchmarks/cgroup.py's (the cnn widened to 64,128 channels, digits drawn at 24x24),
whose fast workers there take 68-92 samples a step.

    python benchmarks/malloc.py [--batches 16,32,64,92,128] [--repeats 3] [--out FILE]

Writes benchmarks/results/malloc.md.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish  # noqa: E402
from upscaled import importable  # noqa: E402

STEPS = 12
WARM = 3
REPEATS = 3

STEP = """
import json, resource, sys, time
from statistics import median_high
import torch
from omnips import data, models
from omnips.flat import FlatModel
from omnips.worker import memory
from omnips.worker.trainer import Trainer
if sys.argv[1] == "kept":
    assert memory.keep_freed_memory(), "not glibc"
torch.set_num_threads(1)
train, _ = data.load("upscaled:digits", {"scale": 3})
trainer = Trainer(FlatModel(models.build("cnn", {"channels": [64, 128]}, train, 0)), data.Batcher(train))
warm, steps, out = int(sys.argv[3]), int(sys.argv[4]), {}
for batch in map(int, sys.argv[2].split(",")):
    cpu, faults = [], []
    for k in range(warm + steps):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
        trainer.compute(list(range(batch)))
        if k >= warm:
            cpu.append(time.process_time() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    out[batch] = (median_high(cpu), median_high(faults))  # (of an even count, the upper of the middle two)
print(json.dumps(out))
"""


def measure(arm: str, batches: list[int]) -> dict[int, tuple[float, int]]:
    out = subprocess.run([sys.executable, "-c", STEP, arm, ",".join(map(str, batches)), str(WARM), str(STEPS)],
                         capture_output=True, text=True, timeout=1800, env={**os.environ, **importable()}, check=False)
    if out.returncode:
        raise SystemExit(f"{arm}: {out.stderr.strip().splitlines()[-1]}")
    return {int(b): tuple(v) for b, v in json.loads(out.stdout).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="16,32,64,92,128")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--out", type=Path, default=HERE / "results" / "malloc.md")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    runs = {"default": [], "kept": []}
    for _ in range(args.repeats):
        for arm in runs:  # in turn: both meet the host's same moments
            runs[arm].append(measure(arm, batches))
    lines = ["# A CPU step's memory: the allocator's default against a step's memory kept", "",
             f"Produced by `benchmarks/malloc.py --batches {args.batches} --repeats {args.repeats}`; "
             "see its docstring.", "", *machine_lines(), "",
             "| batch | CPU ms a step, default | kept | kept / default | page faults a step, default | kept |",
             "|---:|---:|---:|---:|---:|---:|"]
    for b in batches:
        cpu = {arm: 1000 * median(r[b][0] for r in rs) for arm, rs in runs.items()}
        faults = {arm: median(r[b][1] for r in rs) for arm, rs in runs.items()}
        lines.append(f"| {b} | {cpu['default']:.1f} | {cpu['kept']:.1f} | {cpu['kept'] / cpu['default']:.3f} "
                     f"| {faults['default']:.0f} | {faults['kept']:.0f} |")
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
