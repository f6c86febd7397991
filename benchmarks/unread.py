#!/usr/bin/env python
"""What a peer that sends pulls and stops reading the replies costs a server, in copies
of its shard.

One ASP job: a scheduler and one server as processes, this process as the only worker
(as in pushpull.py). A second connection to the server, the puller, sends --pulls pulls
before each of --steps steps of the worker, in two phases: first it reads every reply
(the baseline), then it reads none until the phase is over, its receive queue one
message deep (a peer whose queue is full: the replies stay queued at the server). The
server's peak resident memory (VmHWM; the roles keep freed memory, so it is also what
the process holds afterwards) is read after the warm-up and after each phase. Its rise
over the shard's bytes is the number of shard copies held at once; a copy per reply
would make it pulls x steps in the unread phase.

    python benchmarks/unread.py [--params 11000000] [--pulls 100] [--steps 3]

Prints a table and writes it to benchmarks/results/unread.md.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from pushpull import exchange, job_args, model_size, scheduler_args  # noqa: E402
from report import machine_lines, publish, runs_dir  # noqa: E402
from solo import SoloWorker  # noqa: E402

from omnips import codec  # noqa: E402
from omnips.protocol import Params, Pull  # noqa: E402

READ_TIMEOUT_S = 60.0


def peak_mb(pid: int) -> float:
    """The process's peak resident memory, MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def read_replies(puller: zmq.Socket, count: int) -> None:
    for _ in range(count):
        if not puller.poll(int(READ_TIMEOUT_S * 1000)):
            raise RuntimeError(f"a pull was not answered within {READ_TIMEOUT_S:g} s")
        msg = codec.decode(puller.recv_multipart(copy=False))
        if not isinstance(msg, Params):
            raise RuntimeError(f"a pull was answered with {msg}")


def phase(job: SoloWorker, group, puller: zmq.Socket, read: bool, first_step: int, args, grads, params) -> None:
    """--steps steps of the worker, --pulls pulls before each; the replies read as they
    come, or all at the end."""
    for step in range(first_step, first_step + args.steps):
        for request in range(args.pulls):
            puller.send_multipart(codec.encode(Pull(request=request)))
        if read:
            read_replies(puller, args.pulls)
        job.report(exchange(group, step, grads, params, 0))
    if not read:
        read_replies(puller, args.pulls * args.steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=11_000_000, help="values in the model, about (default 44 MB)")
    p.add_argument("--pulls", type=int, default=100, help="pulls before each step")
    p.add_argument("--steps", type=int, default=3, help="steps of the worker in each phase")
    p.add_argument("--out", type=Path, default=HERE / "results" / "unread.md")
    args = p.parse_args(argv)
    start = time.monotonic()
    steps = 2 * args.steps + 2
    model_args, dataset_args = job_args(args.params, steps)
    n = model_size(model_args, dataset_args)
    shard_mb = 4 * n / 2**20
    rng = np.random.default_rng(0)
    params = (rng.standard_normal(n) * 0.01).astype(np.float32)
    grads = np.full(n, 1e-4, dtype=np.float32)
    ctx = zmq.Context()
    with runs_dir("unread") as root:
        job = SoloWorker(ctx, root / "run", scheduler_args("asp", model_args, dataset_args, 10 ** 9, "127.0.0.1"),
                         1, ["--host", "127.0.0.1"], transport="tcp")
        try:
            group = job.start(n)
            group.init(params)
            group.pull(params)
            for step in range(2):  # warm-up: the server's buffers for a step are all allocated
                job.report(exchange(group, step, grads, params, 0))
            server = job.cluster.procs["server0"].pid
            puller = ctx.socket(zmq.DEALER)
            puller.setsockopt(zmq.RCVHWM, 1)  # unread, its queue is full at once: the rest wait at the server
            puller.connect(group.endpoints[0])
            before = peak_mb(server)
            phase(job, group, puller, True, 2, args, grads, params)
            reading = peak_mb(server)
            phase(job, group, puller, False, 2 + args.steps, args, grads, params)
            unread = peak_mb(server)
            job.finish()
        finally:
            job.stop()
            ctx.destroy(linger=0)
    copies = {name: (mb - before) / shard_mb for name, mb in (("reading", reading), ("unread", unread))}
    print(f"shard {shard_mb:.1f} MB; server peak {before:.0f} MB after the warm-up: {copies['reading']:.2f} shard "
          f"copies more with the reading puller, {copies['unread']:.2f} with the unread one "
          f"({args.pulls * args.steps} replies over {args.steps} steps)")
    lines = [
        "# A puller that stops reading: the server's memory", "",
        *machine_lines(),
        f"- command: `python benchmarks/unread.py {' '.join(sys.argv[1:])}` ({time.monotonic() - start:.0f} s)",
        f"- ASP, one server process over tcp, a {n:,}-value model ({shard_mb:.1f} MB); {args.pulls} pulls before "
        f"each of {args.steps} steps of the worker in each phase", "",
        "| phase | server peak resident memory, MB | over the warm-up, MB | over the warm-up, shard copies |",
        "|---|---:|---:|---:|",
        f"| after the warm-up | {before:.0f} | | |",
        f"| a puller that reads every reply (baseline) | {reading:.0f} | {reading - before:.0f} | "
        f"{copies['reading']:.2f} |",
        f"| then a puller that reads none until the phase is over | {unread:.0f} | {unread - before:.0f} | "
        f"{copies['unread']:.2f} |", "",
        f"The peak only grows: each phase's figure is the larger of its own and the one before. A copy per "
        f"reply would be {args.pulls} copies for the reading puller's burst of pulls, {args.pulls * args.steps} "
        f"({args.pulls * args.steps * shard_mb:.0f} MB) for the unread one's; one per step taken, {args.steps}.",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
