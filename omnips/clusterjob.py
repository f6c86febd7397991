"""A job for a cluster manager: `omnips launch`'s flags, checked as the launcher checks them,
and each role's command line. omnips/slurm.py and omnips/k8s.py render it."""

import argparse
import os
import sys
import time
from dataclasses import dataclass

from .launch import WorkerSpec

# the scheduler's port when a manager cannot pass a chosen one on (Kubernetes: the Service's)
SCHEDULER_PORT = 5555
LOCAL_ONLY = ("--resume", "--timeout", "--no-progress", "--no-plots")  # the launcher's own flags


@dataclass(frozen=True)
class ClusterJob:
    run_dir: str  # absolute: every node must see it at this path
    scheduler_args: list[str]  # the job's flags, without --host/--port/--run-dir
    num_servers: int
    workers: list[WorkerSpec]
    keys: str | None  # absolute path of --keys
    token: str
    transport: str
    python: str

    def gpu_ranks(self) -> list[int]:
        return [r for r, w in enumerate(self.workers) if w.device.startswith("cuda")]

    def cpu_ranks(self) -> list[int]:
        return [r for r, w in enumerate(self.workers) if not w.device.startswith("cuda")]

    def keys_args(self) -> list[str]:
        return ["--keys", self.keys] if self.keys else []

    def scheduler_cmd(self, port: int) -> list[str]:
        return [self.python, "-m", "omnips.scheduler", *self.scheduler_args, "--num-servers", str(self.num_servers),
                "--num-workers", str(len(self.workers)), "--host", "0.0.0.0", "--port", str(port),
                "--run-dir", self.run_dir, *self.keys_args()]

    def server_cmd(self, scheduler, advertise: str | None = None) -> list:
        adv = ["--advertise", advertise] if advertise else []
        return [self.python, "-m", "omnips.server", "--scheduler", scheduler, "--host", "0.0.0.0", *adv, *self.keys_args()]

    def worker_cmd(self, rank: int, scheduler, ask_rank: bool = True) -> list:
        """Worker `rank`'s command line; without `ask_rank` it takes the next free rank. `scheduler`: the
        address, or a stand-in that the renderer writes as a shell variable (as in server_cmd)."""
        ask = ["--rank", str(rank)] if ask_rank else []
        return [self.python, "-m", "omnips.worker", "--scheduler", scheduler, *ask, *self.keys_args(),
                *self.workers[rank].args()]

    def env(self) -> dict[str, str]:
        """What every process's environment carries beyond the flags."""
        env = {"PYTHONUNBUFFERED": "1"}
        if self.transport != "auto":
            env["OMNIPS_TRANSPORT"] = self.transport
        return env


def parse(prog: str, argv: list[str], add_own, python: str = sys.executable) -> tuple[ClusterJob, argparse.Namespace]:
    """`omnips launch`'s flags (and `add_own`'s) into a ClusterJob, refused as the launcher
    refuses them; the namespace carries the manager's own flags. `python`: --python's default."""
    from . import cli
    parser = cli.launch_parser()
    parser.prog = prog
    parser.description = (f"Print a job for a cluster manager. Takes omnips launch's flags (per-worker flags: one "
                          "value for all workers or one per worker; every other flag goes to the scheduler), less "
                          f"{', '.join(LOCAL_ONLY)}, and its own.")
    for action in parser._actions:
        if action.option_strings and action.option_strings[0] in LOCAL_ONLY:
            action.help = argparse.SUPPRESS
    add_own(parser)
    parser.add_argument("--python", default=python,
                        help="the Python every role runs with, on every node (default: this one, %(default)s)")
    args, scheduler_args = parser.parse_known_args(argv)
    if args.resume is not None:
        parser.error("--resume: the job resumes by itself from its run directory's newest checkpoint")
    for flag in LOCAL_ONLY[1:]:
        if getattr(args, flag[2:].replace("-", "_")) != parser.get_default(flag[2:].replace("-", "_")):
            parser.error(f"{flag}: for omnips launch only")
    cli.cluster_size(args, parser)
    workers = cli.worker_specs(args, parser)
    cli.check_job(args, scheduler_args, parser)
    for rank, spec in enumerate(workers):  # the devices are the nodes': not checked here
        from omnips.worker.__main__ import parse as worker_parse
        cli.borrowed_check(parser, f"worker {rank}: ", worker_parse,
                           ["--scheduler", "tcp://127.0.0.1:0", "--rank", str(rank), *spec.args()])
    for flag in ("--host", "--port", "--run-dir"):
        if any(a == flag or a.startswith(flag + "=") for a in scheduler_args):
            parser.error(f"{flag}: set by the generated job")
    run_dir = os.path.abspath(args.run_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
    job = ClusterJob(run_dir, scheduler_args, args.num_servers, workers,
                     os.path.abspath(args.keys.path) if args.keys else None, args.token, args.transport,
                     args.python)
    return job, args
