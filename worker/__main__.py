"""python -m omnips.worker: one training worker (a model replica on its device)."""

import argparse
import logging
import signal
import sys

import zmq

from omnips import logs, transport
from omnips.flags import add_log_level, add_security, add_transport, parse_args, seconds, size
from omnips.job import PREEMPTED_EXIT
from omnips.leaving import Leaving
from omnips.protocol import MAX_BATCH

from .emulation import Emulation, parse_schedule
from .options import WorkerOptions


def _steps(text: str) -> frozenset:
    try:
        return frozenset(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of steps") from None


def parse(argv) -> WorkerOptions:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="omnips-worker", description=__doc__)
    p.add_argument("--scheduler", required=True, help="the scheduler's address, tcp://HOST:PORT")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 (default): an equal share of the cores among the job's "
                   "workers on this host, as the scheduler counts them")
    p.add_argument("--capacity", type=float, default=1.0,
                   help="relative speed declared for --batching static (e.g. core count)")
    p.add_argument("--rank", type=int, default=-1, help="ask for this worker rank (default: the next free one)")
    p.add_argument("--max-batch", type=int, default=0,
                   help="most samples this worker can hold in one pass (larger batches run in chunks)")
    p.add_argument("--memory-limit", type=size, default=0, metavar="SIZE",
                   help="most memory a step may fill, e.g. 2G (default: the device's free memory)")
    p.add_argument("--bucket-size", type=_bucket, default=4 << 20, metavar="SIZE",
                   help="send the gradient in buckets of about SIZE bytes while backward still runs, "
                        "overlapping communication with computation (default 4M; 0: send after backward)")
    p.add_argument("--fault-oom-above", type=int, default=0, help=argparse.SUPPRESS)  # test knob
    p.add_argument("--fault-nan-at", type=_steps, default=frozenset(), help=argparse.SUPPRESS)  # test knob
    p.add_argument("--slowdown", default="1", help="F, or a schedule STEP:F,STEP:F,... (emulated slower device)")
    p.add_argument("--emulate-ms-per-step", type=float, default=0.0, help="virtual device: fixed ms per step (A)")
    p.add_argument("--emulate-ms-per-sample", type=float, default=0.0, help="virtual device: ms per sample (C)")
    p.add_argument("--ack-timeout", type=seconds, default=10.0, help="seconds to wait for the scheduler to answer")
    p.add_argument("--welcome-timeout", type=seconds, default=300.0,
                   help="seconds to wait for the cluster to form, and for the start plan after the probe")
    p.add_argument("--server-timeout", type=seconds, default=120.0, help="seconds to wait for a server's reply")
    add_security(p, listens=False)
    add_transport(p)
    add_log_level(p)
    args = parse_args(p, argv)
    if args.threads < 0:
        p.error("--threads must be >= 0")
    if not 0 <= args.max_batch <= MAX_BATCH or args.fault_oom_above < 0:
        p.error(f"--max-batch must be from 0 to {MAX_BATCH}")
    if args.rank < -1:
        p.error("--rank must be >= 0")
    if not 0 < args.capacity < float("inf"):
        p.error("--capacity must be finite and > 0")
    if not (0 <= args.emulate_ms_per_step < 1e7 and 0 <= args.emulate_ms_per_sample < 1e7):
        p.error("--emulate-ms-per-step/--emulate-ms-per-sample must be between 0 and 1e7")
    try:
        emulation = Emulation(tuple(parse_schedule(args.slowdown)), args.emulate_ms_per_step,
                              args.emulate_ms_per_sample)
    except ValueError as exc:
        p.error(str(exc))
    return WorkerOptions(args.scheduler, args.device, args.threads, args.capacity, args.rank, args.max_batch,
                         args.memory_limit, args.fault_oom_above, args.fault_nan_at, emulation,
                         args.ack_timeout, args.welcome_timeout, args.server_timeout, args.keys, args.token,
                         args.bucket_size, args.transport, args.log_level)


def _bucket(text: str) -> int:
    return 0 if text.strip() == "0" else size(text)


def main(argv=None) -> int:
    opts = parse(argv)
    logs.setup("worker", opts.log_level)  # here, not in parse: a launcher checks workers' flags with it
    transport.tune_malloc()
    from omnips.data import FactoryError  # torch: imported once the flags are known good (seconds)
    from omnips.link import LinkError, Preempted
    from omnips.servers import ServerError
    from .service import run
    leaving = Leaving().install(signal.SIGTERM)  # a graceful leave after the step in flight
    try:
        return run(opts, leaving)
    except Preempted as exc:
        logging.getLogger("omnips.worker").warning("%s", exc)
        return PREEMPTED_EXIT
    except (LinkError, ServerError, FactoryError, transport.TransportError, ValueError, MemoryError,
            zmq.ZMQError) as exc:
        logging.getLogger("omnips.worker").error("%s", exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
