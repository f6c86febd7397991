"""python -m omnips.scheduler: owns the job, forms the cluster, tracks progress, writes the run directory."""

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

from omnips import logs, transport
from omnips.flags import add_log_level, add_security, add_transport, host, nonempty, port, seconds
from omnips.job import (ASYNC_CORRECTIONS, BATCHINGS, CONTROLLERS, MODES, NAN_POLICIES, OPTIMIZERS, STALENESS_LR,
                        WIRE_DTYPES, JobSpec)

from omnips.metrics import RunDirInUse

from .checkpoints import resume_point
from .status_server import status_port


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text, parse_constant=_not_json)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"hidden\": [256]}'")
    return value


def _not_json(name: str):
    # NaN and Infinity are not JSON: config.json would record them as null, another job
    raise ValueError(f"{name} is not a JSON value")


def parser() -> argparse.ArgumentParser:
    d = JobSpec()
    p = argparse.ArgumentParser(allow_abbrev=False, prog="omnips-scheduler", description=__doc__)
    p.add_argument("--mode", choices=MODES, default=d.mode,
                   help="bsp: synchronous; asp: asynchronous; ssp: asynchronous within --staleness steps")
    p.add_argument("--staleness", type=int, default=d.staleness,
                   help="ssp: how many steps a worker may run ahead of the slowest")
    p.add_argument("--staleness-lr", choices=STALENESS_LR, default=d.staleness_lr,
                   help="asp/ssp: 'inverse' divides an update's learning rate by 1 + its staleness")
    p.add_argument("--async-correction", choices=ASYNC_CORRECTIONS, default=d.async_correction,
                   help="asp/ssp: how a server allows for the staleness of each update: dana keeps SGD's "
                        "momentum in one buffer per worker and keeps the values moved ahead along them "
                        "(with Adam: momentum's update); momentum lowers the momentum by the implicit momentum "
                        "of the measured staleness; lookahead, dc (delay compensation) and gap (gap-aware "
                        "damping) keep a shard-sized buffer (dc, gap: one per worker); none: the plain update "
                        "(docs/asynchronous-updates.md; default %(default)s)")
    p.add_argument("--num-servers", type=int, default=d.num_servers)
    p.add_argument("--num-workers", type=int, default=d.num_workers, help="worker ranks (the most at once)")
    p.add_argument("--min-workers", type=int, default=d.min_workers,
                   help="start once this many workers are in; the others join the running job (default: all)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=port, default=0, help="port to bind; 0 picks a free one (printed)")
    p.add_argument("--status-host", type=host, default="127.0.0.1",
                   help="address the status server binds: IPv4, IPv6 or a host name (default loopback; another one "
                        "is reachable by anyone who can reach it: give the job a --token); '::' takes IPv4 and IPv6")
    p.add_argument("--status-port", type=status_port, default=0, metavar="PORT|off",
                   help="the status server's port: GET / (a page), /status.json, /metrics (Prometheus); "
                        "0 picks a free one (printed); off: none (default 0)")
    p.add_argument("--model", default=d.model, help="mlp, cnn, resnet, or pkg.module:fn")
    p.add_argument("--model-args", type=_json_object, default={}, help="JSON object passed to the model factory")
    p.add_argument("--dataset", default=d.dataset, help="digits, synthetic, or pkg.module:fn")
    p.add_argument("--dataset-args", type=_json_object, default={}, help="JSON object passed to the dataset factory")
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer)
    p.add_argument("--lr", type=float, default=d.lr,
                   help="the step per global batch: BSP applies it once a step to the batch-weighted mean "
                        "gradient; asp/ssp scale it to each update's share of the global batch, lr * b_i / B (with "
                        "--async-correction none: lr * b_i / (B / N)), so a BSP recipe carries over unchanged "
                        "(default %(default)s)")
    p.add_argument("--momentum", type=float, default=d.momentum)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many global batches")
    p.add_argument("--batching", choices=BATCHINGS, default=d.batching,
                   help="uniform: equal batches; static: by declared capacity; dynamic: the controller")
    p.add_argument("--controller", choices=CONTROLLERS, default=d.controller,
                   help="dynamic batching: affine (fits t = a + c*b per worker) or proportional (the paper's rule)")
    p.add_argument("--adjust-every", type=int, default=d.adjust_every,
                   help="dynamic batching: steps measured per worker between adjustments")
    p.add_argument("--deadband", type=float, default=d.deadband,
                   help="dynamic batching: relative batch change below which nothing changes")
    p.add_argument("--no-probe", dest="probe", action="store_false",
                   help="dynamic batching: start from the equal (or --capacity) split instead of planning the first "
                        "step from two timed passes on every worker")
    p.add_argument("--min-batch", type=int, default=d.min_batch, help="smallest per-worker batch")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="largest per-worker batch (default: no limit)")
    p.add_argument("--nan-policy", choices=NAN_POLICIES, default=d.nan_policy,
                   help="a worker's gradient with NaN or inf: fail ends the job (default), skip drops that gradient")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, default=d.wire_dtype,
                   help="what gradient pushes and the shards that answer them travel as: float32 (default, exact), "
                        "or bfloat16 / float16 (half the bytes; servers keep float32 values and optimizer state; "
                        "a float16 gradient beyond +-65504 counts as non-finite, see --nan-policy)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--run-dir", type=nonempty, default=None,
                   help="where config.json, metrics.jsonl, summary.json go (default runs/YYYYmmdd-HHMMSS); "
                        "a directory that holds another run is refused")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="write a checkpoint of every server's shard and optimizer state under RUN_DIR/checkpoints "
                        "every STEPS steps (asp/ssp: updates); 0: none")
    p.add_argument("--resume", type=nonempty, default=None, metavar="RUN_DIR",
                   help="continue the interrupted run in RUN_DIR from its newest complete checkpoint, with the job "
                        "of its config.json (job flags, if given, must match it); 'auto': the run in --run-dir if "
                        "it holds one, else start it there (one command for a job that may be preempted)")
    p.add_argument("--tensorboard", type=nonempty, default=None, metavar="DIR",
                   help="write TensorBoard scalars into DIR as the job runs: loss, accuracy, samples/s, per-worker "
                        "batch, compute time and staleness (needs pip install 'omnips[tensorboard]')")
    p.add_argument("--heartbeat", type=seconds, default=1.0, help="seconds between heartbeats")
    p.add_argument("--dead-after", type=seconds, default=30.0,
                   help="seconds of silence after which a worker leaves the job, a server fails it, and a process "
                   "that hears nothing from the scheduler gives up")
    p.add_argument("--register-timeout", type=seconds, default=300.0, help="seconds for the cluster to form")
    p.add_argument("--stall-timeout", type=seconds, default=300.0, help="seconds without progress before failing")
    add_security(p, listens=True)
    add_transport(p)
    add_log_level(p)
    return p


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    logs.setup("scheduler", a.log_level)
    try:
        check_run_flags(a)
    except ValueError as exc:
        p.error(str(exc))

    if a.resume == "auto":
        if a.run_dir is None:
            p.error("--resume auto needs --run-dir: the directory a preempted run goes on in")
        a.resume = a.run_dir if (Path(a.run_dir) / "config.json").exists() else None
    resume = None
    if a.resume is None:
        try:
            job = job_from(a)
        except ValueError as exc:
            p.error(str(exc))
    else:
        if a.run_dir is not None and Path(a.run_dir).resolve() != Path(a.resume).resolve():
            p.error(f"--run-dir {a.run_dir} differs from --resume {a.resume}: a resumed run continues in its directory")
        try:
            job, resume = resume_point(Path(a.resume))
        except ValueError as exc:
            logging.getLogger("omnips.scheduler").error("%s", exc)
            return 1
        actions = {action.dest: action for action in p._actions if action.option_strings}
        for name, value in _given_job_flags(argv).items():
            if value != getattr(job, name):
                flag = actions[name].option_strings[0]
                given = f"{flag} differs from the resumed job ({name} {getattr(job, name)})" \
                    if actions[name].nargs == 0 else f"{flag} {value} differs from the resumed job's {getattr(job, name)}"
                p.error(f"{given}: a resumed job keeps its settings")
        a.run_dir = a.resume
    transport.tune_malloc()
    from omnips.data import FactoryError  # torch: imported once the flags are known good (seconds)
    from .service import Scheduler, SchedulerOptions
    opts = SchedulerOptions(a.host, a.port, a.run_dir or time.strftime("runs/%Y%m%d-%H%M%S"), a.heartbeat, a.dead_after, a.register_timeout,
                            a.stall_timeout, checkpoint_every=a.checkpoint_every, keys=a.keys, token=a.token,
                            transport=a.transport, status_host=a.status_host, status_port=a.status_port)
    board = None
    if a.tensorboard is not None:  # before the run starts: a missing package is a start-up error
        from omnips.scalars import ScalarsError, TensorBoard
        try:
            board = TensorBoard(a.tensorboard, job.num_workers, wall0=time.time())
        except (ScalarsError, OSError) as exc:
            logging.getLogger("omnips.scheduler").error("--tensorboard: %s", exc)
            return 1
    try:
        scheduler = Scheduler(job, opts, resume=resume)
    except (FactoryError, ValueError, OSError, RunDirInUse, transport.TransportError) as exc:
        logging.getLogger("omnips.scheduler").error("%s", exc)
        if board is not None:
            board.close()
        return 1
    if board is not None:
        run = scheduler.run
        board.wall0 = time.time() - (run.clock() - run.t0)  # the wall-clock time of the run's t = 0
        run.watchers.append(board)
    # a stop asked by a signal (a batch system's SIGTERM, its SIGUSR1 warning ahead of the time limit, a
    # user's Ctrl-C) writes the model, a checkpoint and the summary first, and exits with PREEMPTED_EXIT
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: scheduler.request_stop(signal.Signals(signum).name))
    return scheduler.serve()


def check_run_flags(args: argparse.Namespace) -> None:
    """ValueError if the flags that are not the job's cannot work together."""
    if args.dead_after <= 2 * args.heartbeat:
        raise ValueError("--dead-after must be more than twice --heartbeat")
    if args.checkpoint_every < 0:
        raise ValueError("--checkpoint-every must be >= 0")


def job_from(args: argparse.Namespace) -> JobSpec:
    """The job parsed flags describe (one flag per setting); ValueError if it cannot run."""
    job = JobSpec(**{f.name: getattr(args, f.name) for f in fields(JobSpec)})
    job.check()
    return job


def _given_job_flags(argv) -> dict:
    """The job settings named on the command line (not left at their defaults)."""
    unset = object()  # not a string: argparse would run a string default through the flag's type
    names = [f.name for f in fields(JobSpec)]
    p = parser()
    p.set_defaults(**{name: unset for name in names})
    given = vars(p.parse_args(argv))
    return {name: given[name] for name in names if given[name] is not unset}


if __name__ == "__main__":
    sys.exit(main())
