#!/usr/bin/env python
"""Dynamic batching on real compute under CPU quotas: equal batches against the controller.

No emulation: every worker runs its real forward and backward (the cnn on digits, one
torch thread), inside a cgroup of its own whose CPU quota makes it slower (benchmarks/
quota.py; the paper made its heterogeneity levels with container CPU limits). BSP, 4
workers, one server, --global-batch 128, a fixed --max-steps budget. The cnn is widened
(--channels, default 64,128: 16x the default cnn's compute) and the digits drawn three times
as large (--scale 3, benchmarks/upscaled.py: 9x the compute again, with the same
parameters and the same 1,437 training samples an epoch), so that a step spans tens of
the quota's 10 ms periods, as a real job's second-long steps span a container's 100 ms
ones. A step of a few periods takes one period more or less by chance, the quota's
granularity, not the machine's speed: at the smaller sizes
(benchmarks/results/cgroup-scale1.md, cgroup-scale2.md) even the plan the quotas call for,
and at HL1 the uniform plan (the ideal one there), reached less of the ideal. (A larger
global batch would lengthen the steps too, but digits' epochs would shrink to a few
steps, and each epoch's evaluation disturbs the steps around it.) Each job's workers'
quotas share a third of --cores (default: the machine's cores less HEADROOM for the
schedulers, the servers and the system) in the paper's heterogeneity levels, the speeds of
benchmarks/efficiency.py (HL1 12/12/12/12, HL2 12/12/8/16, HL4 9/9/6/24, HL8 6/6/4/32).
A quota makes a slower machine only where the host can give the worker its quota: with
half a core left to the rest on 2 cores (benchmarks/results/cgroup-113953a.md), the three
schedulers' evaluations and the servers contended with the workers, and the static plan's
workers' steps varied by 7-16 % (coefficient of variation) with no change of speed; with
0.8 cores left (cgroup-cores12-58077eb.md and the table at 6839797) by 4-9 %, and the
uniform plan at HL1, the ideal one there, reached 0.950-0.953 of the ideal instead of
0.914-0.935. The host's own noise still comes and goes: in a later stretch, its steps 10 %
slower, they varied by 9-18 % again (cgroup-repeats-6839797.md).
Besides the levels:

* neighbour: HL4, and a CPU hog started in worker 0's cgroup for the middle third of the
  steps (a noisy neighbour in its container: it halves what that worker gets);
* one-sided: HL4, and worker 3's quota halved for the middle third (its host busy);
* loaded: HL4 with `nproc` busy processes on the host, outside the quotas, all the run.

Each case runs three jobs at once: with equal batches (uniform), with --batching dynamic
(affine), and with --batching static, each worker declaring its quota's share as its
--capacity (the plan a known speed calls for, a reference no controller needs to beat).
Run one after another, even interleaved, they met different machines: this host's speed
moved by up to a third between consecutive runs (one HL8 dynamic job took 66 to 89 s
within half an hour), far more than the 2 % the ratio is judged by. At once, the three
share every slow stretch, and the quotas keep each job's workers from taking the others'
CPU (only what runs outside them, the schedulers, the servers and the system, is shared).
Then the dynamic job runs once more, alone, on the same quotas (--no-alone leaves it out):
its efficiency is what a job on hosts of its own reaches, as the emulated figures were
measured. Memory new to the machine costs a worker far more beside the other two jobs than
alone (the three take several GiB at once): before workers warmed their heap
(worker/memory.warm_heap), a step in which a worker's heap grew ran 2-5x its others
(benchmarks/results/cgroup-alone-3fb511d.md), and now each worker's first step at a larger
batch carries the warming. The efficiency targets are judged both ways.
Reported per run: wall time, and the dynamic run's time over
the uniform one's (the target: at most 1.02); efficiency = ideal time / wall time, the
ideal being each step's global batch at the sum of the workers' own throughputs at the
batches they had (benchmarks/efficiency.py's definition); balance = the ideal over
the slowest worker's compute summed over steps (communication left out); the dynamic run's
efficiency over the static one's (what of the reachable the controller reaches: the
communication, the host's noise per step and the evaluations bound both); the final plan,
adjustments, the periods in which the slowest worker ran out of quota (that the
quota is what made it slow), and the slowest and the fastest worker's median overhead a
step in the dynamic run (the step outside compute and the servers' hold, which dynamic
batching plans with the compute: a slow host is slow at both), and the efficiency from step 1
on (ideal over the time from step 0's end to the last step's: the start left out, the probe
and the first touch of each worker's memory, which a job of 100 steps pays a larger share of
than a long one; the verdicts judge the whole job). The efficiency verdicts take
each case's mean over its repeats (one run of a case moves by 2-4 points from the next), the
lowest single run beside it; dynamic / uniform is judged on the worst run, and so is the
longest run of windows in which the dynamic job held a plan other than the uniform split
more than 2 % slower than the uniform job at the same moment (benchmarks/worse_windows.py;
the target: at most two).

    python benchmarks/cgroup.py [--quick] [--cases HL2,HL8,neighbour] [--steps 100] [--repeats 2]
        [--cores 1.5] [--channels 64,128] [--global-batch 128] [--keep-runs] [--out FILE]

Writes benchmarks/results/cgroup.md. Needs root and cgroup cpu quotas (benchmarks/quota.py).
"""

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from cgroup_report import VARIANTS, table, verdicts  # noqa: E402
from efficiency import LEVELS, Scenario, analyse  # noqa: E402
from quota import CpuQuota, available  # noqa: E402
from report import machine_lines, publish, runs_dir  # noqa: E402
from upscaled import importable  # noqa: E402
from worse_windows import timeline  # noqa: E402

from omnips.launch import LaunchError, LocalCluster, WorkerSpec  # noqa: E402
from omnips.metrics import read_events  # noqa: E402

CASES = ("HL1", "HL2", "HL4", "HL8", "neighbour", "one-sided", "loaded")
HEADROOM = 0.8  # cores left outside the quotas: see the docstring
JOB_TIMEOUT_S = 1800
HOG = [sys.executable, "-c", "while True: pass"]


@dataclass(frozen=True)
class Case:
    name: str
    speeds: tuple[float, ...]
    event: str = ""  # "neighbour", "one-sided" or "loaded"


def case(name: str) -> Case:
    if name in LEVELS:
        return Case(name, LEVELS[name])
    return Case(name, LEVELS["HL4"], name)


@dataclass(frozen=True)
class Size:
    channels: list[int]
    global_batch: int
    scale: int  # digits drawn scale times larger (benchmarks/upscaled.py)

    def __str__(self) -> str:
        return (f"cnn channels {','.join(map(str, self.channels))}, global batch {self.global_batch} on digits "
                f"at {8 * self.scale}x{8 * self.scale}")


def job_args(variant: str, steps: int, seed: int, size: Size) -> list[str]:
    batching = {"affine": ["--batching", "dynamic", "--controller", "affine"], "uniform": ["--batching", "uniform"],
                "static": ["--batching", "static"]}[variant]
    return ["--mode", "bsp", "--model", "cnn", "--model-args", json.dumps({"channels": size.channels}),
            "--dataset", "upscaled:digits", "--dataset-args", json.dumps({"scale": size.scale}),
            "--global-batch", str(size.global_batch), "--lr", "0.05", "--max-steps", str(steps), "--seed", str(seed),
            *batching]


def reached(run_dir: Path, count, n: int, stop: threading.Event, what: str, timeout_s: float | None = None) -> bool:
    """Wait until `count` of the job's events (its metrics file read whole: none yet, or torn,
    count 0) reaches `n`: True; False when `stop` was set first. SystemExit past `timeout_s`,
    naming the run and `what` was counted (None: the job's end sets `stop`)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set():
        try:
            got = count(read_events(run_dir))
        except (OSError, ValueError):
            got = 0
        if got >= n:
            return True
        if deadline is not None and time.monotonic() > deadline:
            raise SystemExit(f"{run_dir.name}: {got} of {n} {what} in {timeout_s:.0f} s")
        stop.wait(0.2)
    return False


def at_step(run_dir: Path, step: int, stop: threading.Event) -> bool:
    """Wait until the job has run `step` steps (False: it ended first)."""
    return reached(run_dir, lambda events: sum(e["event"] == "step" for e in events) // 4, step, stop, "steps")


def middle_third(c: Case, quotas: list[CpuQuota], run_dir: Path, steps: int, stop: threading.Event) -> None:
    """The case's event over the middle third of the steps."""
    if not at_step(run_dir, steps // 3, stop):
        return
    hog = None
    if c.event == "neighbour":
        hog = subprocess.Popen(HOG)
        quotas[0].add(hog.pid)
    else:
        quotas[3].set(quotas[3].cores / 2)
    try:
        at_step(run_dir, 2 * steps // 3, stop)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
        else:
            quotas[3].set(quotas[3].cores * 2)


@dataclass
class Together:
    """What the jobs of a case share: their clusters (for run_case to stop), `failed` (set by a job
    that failed, which stops the clusters put there by then) and `formed`, which every job passes
    once its scheduler and servers are up, before any starts its workers: the jobs' steps begin
    together, and no job's first steps meet the others' schedulers and servers importing torch
    and warming up outside the quotas."""
    clusters: list
    failed: threading.Event
    formed: threading.Barrier


def servers_joined(run_dir: Path, servers: int, failed: threading.Event, timeout_s: float = 300.0) -> bool:
    """Wait until the job's scheduler has taken in its `servers` (after its own warm-up: it
    takes them in from its loop), False if a job of the case failed first. SystemExit past
    `timeout_s`."""
    return reached(run_dir, lambda events: sum(e["event"] == "membership" and e["role"] == "server" for e in events),
                   servers, failed, "server(s) joined", timeout_s)


def run(root: Path, c: Case, variant: str, steps: int, cores: float, seed: int, size: Size,
        together: Together, tag: str = "") -> dict:
    """One job of the case, started with the others (`together`); `tag`: a suffix naming its
    run directory and cgroups apart."""
    run_dir = root / f"{c.name}-{variant}{tag}-{seed}"
    # static: each worker declares its quota's share as its capacity, the plan a known speed calls for
    specs = [WorkerSpec(capacity=float(s) if variant == "static" else 1.0) for s in c.speeds]
    cluster = LocalCluster(run_dir, job_args(variant, steps, seed, size), 1, specs, env=importable())
    together.clusters.append(cluster)
    shares = [cores * s / sum(c.speeds) for s in c.speeds]
    slowest, fastest = c.speeds.index(min(c.speeds)), c.speeds.index(max(c.speeds))
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        quotas = [stack.enter_context(CpuQuota(f"omnips-{os.getpid()}-{variant}{tag}-w{i}", share))
                  for i, share in enumerate(shares)]
        try:
            cluster.start_scheduler()
            cluster.start_servers()
            if servers_joined(run_dir, 1, together.failed):
                together.formed.wait(JOB_TIMEOUT_S)
                for rank in range(4):
                    quotas[rank].add(cluster.procs[cluster.add_worker(specs[rank], rank)].pid)
            if together.failed.is_set():  # another job failed while this one started: it may have missed this cluster
                raise SystemExit(f"{c.name} {variant}: stopped, another job of the case failed")
            event = threading.Thread(target=middle_third, args=(c, quotas, run_dir, steps, stop), daemon=True)
            if c.event in ("neighbour", "one-sided"):
                event.start()
            code = cluster.wait(JOB_TIMEOUT_S)
        except LaunchError as exc:
            raise SystemExit(f"{c.name} {variant}: {exc}") from None
        except threading.BrokenBarrierError:  # another job failed, or the others did not form in time
            raise SystemExit(f"{c.name} {variant}: stopped, the case's other jobs did not start") from None
        finally:
            stop.set()
            cluster.stop()
        throttled = quotas[slowest].throttled()
    if code != 0:
        raise SystemExit(f"{c.name} {variant}: the scheduler exited {code} (run dir {run_dir})")
    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_events(run_dir)
    scenario = Scenario(c.name, ("1",) * 4, tuple(float(s) for s in c.speeds), ("--max-steps", str(steps)),
                        ((1.0,) * 4,))
    a = analyse(events, summary, scenario)
    return {"case": c.name, "variant": variant, "wall_s": summary["wall_s"], "efficiency": a["efficiency"],
            "steps_efficiency": a["steps_efficiency"], "balance": a["balance"], "final": summary["final_batches"],
            "adjustments": summary["adjustments"],
            "throttled": throttled, "accuracy": summary["final_test_accuracy"],
            "overhead_ms": [overhead_ms(events, w) for w in (slowest, fastest)], "timeline": timeline(events, 4)}


def overhead_ms(events: list[dict], worker: int) -> float:
    """The worker's median step overhead (outside compute and the servers' hold), in ms."""
    return 1000 * median(e["overhead_s"] for e in events if e["event"] == "step" and e["worker"] == worker)


def run_case(root: Path, c: Case, steps: int, cores: float, seed: int, size: Size,
             variants: tuple[str, ...] = VARIANTS, tag: str = "") -> list[dict]:
    """The case's jobs, one per variant, all at once, each on a third of `cores` (also where
    `variants` are fewer: the alone run's quotas are the same): they meet the same host at the
    same moment (see the docstring). A job that fails, or the benchmark stopped, ends them all
    (each thread then removes its cgroups)."""
    # (failed is set before the clusters are stopped: a job starting meanwhile sees it)
    together = Together([], threading.Event(), threading.Barrier(len(variants)))
    results, errors = {}, []

    def job(variant: str) -> None:
        try:
            results[variant] = run(root, c, variant, steps, cores / len(VARIANTS), seed, size, together, tag)
        except BaseException as exc:  # (SystemExit included: the failure is the benchmark's)
            errors.append(exc)
            together.failed.set()
            together.formed.abort()
            for cluster in list(together.clusters):
                cluster.stop(grace_s=0.0)

    with contextlib.ExitStack() as stack:
        hogs = [subprocess.Popen(HOG) for _ in range(os.cpu_count() if c.event == "loaded" else 0)]
        stack.callback(lambda: [h.kill() or h.wait() for h in hogs])
        threads = [threading.Thread(target=job, args=(variant,)) for variant in variants]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        finally:  # stopped meanwhile (SIGTERM's SystemExit lands here): end every job first
            together.failed.set()
            together.formed.abort()
            for cluster in list(together.clusters):
                cluster.stop(grace_s=0.0)
            for t in threads:
                t.join()
    if errors:
        raise errors[0]
    return [results[variant] for variant in variants]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, help="runs of each case (default 2; --quick: 1)")
    p.add_argument("--cores", type=float, default=max(0.5, len(os.sched_getaffinity(0)) - HEADROOM),
                   help="CPU the jobs' workers share, a third each")
    p.add_argument("--channels", default="64,128", help="the cnn's channels (default %(default)s)")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--scale", type=int, default=3, help="digits drawn this many times larger (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="HL4 and neighbour, 45 steps: a smoke run")
    p.add_argument("--no-alone", action="store_true",
                   help="leave out the dynamic job's run alone after each case's three (see the docstring)")
    p.add_argument("--keep-runs", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "cgroup.md")
    args = p.parse_args(argv)
    # a stopped benchmark still ends its jobs and removes its cgroups (the ExitStack unwinds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    why = available()
    if why:
        print(f"cgroup benchmark skipped: {why}", file=sys.stderr)
        return 2
    names = ["HL4", "neighbour"] if args.quick else args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    steps = 45 if args.quick else args.steps
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, not {args.repeats}")
    repeats = args.repeats or (1 if args.quick else 2)
    size = Size([int(c) for c in args.channels.split(",")], args.global_batch, args.scale)
    results = []
    with runs_dir("omnips-cgroup-", args.keep_runs) as root:
        for name in names:
            for rep in range(repeats):
                runs = run_case(root, case(name), steps, args.cores, rep, size)
                labelled = [(r["variant"], r) for r in runs]
                if not args.no_alone:
                    alone = run_case(root, case(name), steps, args.cores, rep, size, ("affine",), "-alone")[0]
                    runs[VARIANTS.index("affine")]["alone"] = alone
                    labelled.append(("affine alone", alone))
                for label, r in labelled:
                    print(f"{name} #{rep + 1} {label}: {r['wall_s']:.2f} s, efficiency {r['efficiency']:.3f}, "
                          f"final {r['final']}", flush=True)
                results.extend(runs)
    command = " ".join(["benchmarks/cgroup.py", *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
    lines = ["# Dynamic batching on CPU quotas (real compute)", "",
             f"Produced by `{command}`; see its docstring.", "",
             *machine_lines(),
             f"- load average (1 min) at the end: {os.getloadavg()[0]:.1f}",
             f"- the {len(VARIANTS)} jobs of a case run at once, each job's workers' quotas sharing "
             f"{args.cores / len(VARIANTS):.3g} cores (cgroup periods of 10 ms, longer under a tenth of a core); "
             f"{size}, BSP, 4 workers, 1 server, {steps} steps"
             + ("" if args.no_alone else "; then the dynamic job again, alone on the host, on the same quotas"), "",
             *table(results, repeats), "", *verdicts(results)]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
