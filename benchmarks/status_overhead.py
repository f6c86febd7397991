#!/usr/bin/env python
"""What the status server costs the scheduler's loop: CPU time per worker report, with it
off (the baseline) and on, runs interleaved (off, on, off, on, ...) in one process so
that both see the same load.

The scheduler's own report handling (its core's events, the driver carrying out the
instructions, then the status server's once-a-turn tick, as its loop does) is driven
in-process with --workers simulated BSP workers (no server or worker process runs; replies go to a socket without peers), each
run a fresh scheduler through --steps global steps. With the status server on, a
client thread scrapes /metrics and /status.json every few seconds (--rows) meanwhile,
so the cost of answering it (its share of the GIL) is counted too. A third run per
round, off again, measures the method's own noise.

    python benchmarks/status_overhead.py [--workers 64] [--steps 100] [--rounds 12]

Prints a table and writes it to benchmarks/results/status_overhead.md.
"""

import argparse
import logging
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish  # noqa: E402

from omnips.job import JobSpec  # noqa: E402
from omnips.protocol import Register, Report  # noqa: E402
from omnips.status import StatusBook  # noqa: E402
from omnips.scheduler.instructions import AskEval, ConnectServers  # noqa: E402
from omnips.scheduler.service import Scheduler, SchedulerOptions  # noqa: E402


def scheduler(run_dir: Path, workers: int, steps: int, batching: str, status: bool) -> Scheduler:
    job = JobSpec(num_servers=1, num_workers=workers, global_batch=8 * workers, max_steps=steps + 1,
                  batching=batching, probe=False, adjust_every=10)
    job.check()
    s = Scheduler(job, SchedulerOptions(run_dir=str(run_dir), status_port=0 if status else None),
                  announce=lambda *a, **k: None)
    handle(s, b"S", Register(role="server", host="h", endpoint="tcp://127.0.0.1:1"))
    for r in range(workers):
        handle(s, b"W%d" % r, Register(role="worker", host=f"w{r}", rank=r))
    return s


def handle(s: Scheduler, peer: bytes, msg) -> None:
    """`msg` from `peer` through the scheduler's core and driver; no server runs: pulls would
    have nobody to go to."""
    s.execute([i for i in s.core.handle(peer, msg, time.monotonic()) if not isinstance(i, (ConnectServers, AskEval))])


def scraper(url: str, every_s: float, stop: threading.Event, count: list) -> None:
    while not stop.wait(every_s):
        for path in ("metrics", "status.json"):
            with urllib.request.urlopen(url + path, timeout=10) as r:
                r.read()
            count[0] += 1


def run(root: Path, n: int, args, batching: str, status: bool, scrape_every: float) -> tuple[float, float]:
    """Seconds of the loop's CPU time per report, over --steps steps of --workers workers."""
    s = scheduler(root / f"run{n}", args.workers, args.steps, batching, status)
    stop, scrapes = threading.Event(), [0]
    thread = None
    if status:
        thread = threading.Thread(target=scraper, args=(s.status.url, scrape_every, stop, scrapes), daemon=True)
        thread.start()
    reports = [[Report(rank=r, step=step, batch=8, compute_s=0.01 * (1 + r % 4), network_s=0.002, wait_s=0.001,
                       loss=1.0, mem_free=1 << 30, sample_bytes=1000) for r in range(args.workers)]
               for step in range(args.steps)]
    peers = [b"W%d" % r for r in range(args.workers)]
    try:
        start = time.thread_time()  # this thread's CPU: the scraper's own work is not the loop's
        wall = time.perf_counter()
        for step_reports in reports:
            for peer, report in zip(peers, step_reports):
                handle(s, peer, report)
                s.status.tick(time.monotonic())
        cpu, wall = time.thread_time() - start, time.perf_counter() - wall
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=10)
        s.router.close(0)
        s._close(linger=0)
        s.run.close()
    assert not status or scrapes[0] > 0 or wall < scrape_every, "the scraper never got an answer"
    return wall / (args.steps * args.workers), cpu / (args.steps * args.workers)


def fold_cost(workers: int, steps: int) -> float:
    """µs per step event folded into a StatusBook, the tap's whole work per report."""
    book = StatusBook({"mode": "bsp", "num_servers": 1}, "", 0.0)
    book.add({"event": "start", "t": 0.0, "num_params": 10, "train_size": 1000, "budget_epochs": 1e6})
    events = [{"event": "step", "t": 0.01 * i, "worker": i % workers, "step": i // workers, "batch": 8,
               "epoch": i * 8 / 1000, "compute_s": 0.01, "network_s": 0.002, "overhead_s": 0.003, "wait_s": 0.001,
               "loss": 1.0, "staleness": 0, "mem_batch": 0, "mem_free": 1 << 30, "sample_bytes": 1000}
              for i in range(workers * steps)]
    start = time.thread_time()
    for e in events:
        book.add(e)
    return 1e6 * (time.thread_time() - start) / len(events)


KINDS = ("off", "on", "off again")  # the last: a second baseline, whose ratio to the first is the noise alone


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=12, help="rounds of three runs (off, on, off again) per row")
    p.add_argument("--rows", nargs="+", default=["uniform:1", "dynamic:1", "uniform:0.1"], metavar="BATCHING:SCRAPE",
                   help="batching and seconds between scrapes while on: the page refreshes every 1 s; "
                        "Prometheus scrapes every 15 s by default")
    p.add_argument("--out", type=Path, default=HERE / "results" / "status_overhead.md")
    args = p.parse_args()
    logging.getLogger("omnips").setLevel(logging.ERROR)  # each run's replies go nowhere, and say so
    began = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="omnips-status-bench-") as tmp:
        n = 0
        for row in args.rows:
            batching, every = row.split(":")
            got = {kind: ([], []) for kind in KINDS}  # kind -> (wall, cpu) per round
            for i in range(args.rounds):
                for kind in KINDS[i % 3:] + KINDS[:i % 3]:  # each kind first, second and last in turn
                    wall, cpu = run(Path(tmp), n, args, batching, kind == "on", float(every))
                    got[kind][0].append(wall)
                    got[kind][1].append(cpu)
                    n += 1
            rows.append((batching, float(every), got))
    book_us = fold_cost(args.workers, args.steps)
    us = lambda xs: f"{1e6 * statistics.median(xs):.1f}"  # noqa: E731

    def ratio(got, kind, m):
        xs = [b / a for a, b in zip(got["off"][m], got[kind][m])]
        q = statistics.quantiles(xs, n=4)
        return f"{statistics.median(xs):.3f} ({q[0]:.3f}-{q[2]:.3f})"

    lines = ["# The status server's cost to the scheduler's loop", "", *machine_lines(),
             f"- command: `python benchmarks/status_overhead.py --workers {args.workers} --steps {args.steps} "
             f"--rounds {args.rounds} --rows {' '.join(args.rows)}` ({time.monotonic() - began:.0f} s)",
             f"- BSP, {args.workers} simulated workers, {args.steps} global steps a run, each run a fresh "
             "scheduler; per round three runs, the status server off, on, and off again, in turn order; on: "
             "/metrics and /status.json scraped every `scrape` seconds meanwhile", "",
             "| batching | scrape, s | µs per report, wall: off, on | on/off, wall | off again/off, wall | "
             "µs CPU: off, on | on/off, CPU | off again/off, CPU |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for batching, every, got in rows:
        lines.append(f"| {batching} | {every:g} | {us(got['off'][0])}, {us(got['on'][0])} | {ratio(got, 'on', 0)} | "
                     f"{ratio(got, 'off again', 0)} | {us(got['off'][1])}, {us(got['on'][1])} | "
                     f"{ratio(got, 'on', 1)} | {ratio(got, 'off again', 1)} |")
    lines += ["", f"Medians over {args.rounds} rounds, quartiles in brackets. A ratio is a run over the off run of "
              "its round; off again/off is two runs alike, the noise of the method on this machine under this load: "
              "an on/off within it is no measurable cost. Wall time includes what the server's threads take "
              "from the loop (the GIL); CPU time is the loop thread's own.", "",
              f"The status book alone folds a report's step event in {book_us:.2f} µs ({args.workers} x "
              f"{args.steps} events)."]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
