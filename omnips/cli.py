"""The user's command: `omnips launch` starts a whole local cluster and shows its progress;
`omnips plot RUN_DIR` draws a run; `omnips status ADDRESS|RUN_DIR` shows a job's status;
`omnips export tensorboard RUN_DIR` writes its scalars for TensorBoard; `omnips keygen DIR` makes
the keys for --keys; `omnips slurm` and `omnips k8s` print the job for a cluster manager."""

import argparse
import contextlib
import io
import json
import signal
import sys
import time
from pathlib import Path

from . import security
from .flags import add_security, add_transport, duration, nonempty
from .job import PREEMPTED_EXIT, JobSpec
from .launch import LaunchError, LocalCluster, WorkerSpec
from .plot import PlotError, plot_run
from .status import ETA_WINDOW_S, eta_s, wait_text
from .status import duration as readable  # (flags.duration is --timeout's type)

PER_WORKER = {  # launcher flag -> (WorkerSpec field, type)
    "capacity": ("capacity", float),
    "slowdown": ("slowdown", str),
    "emulate_ms_per_step": ("ms_per_step", float),
    "emulate_ms_per_sample": ("ms_per_sample", float),
    "threads": ("threads", int),
    "device": ("device", str),
}


def launch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnips launch", allow_abbrev=False,
        description="Start a scheduler, S servers and N workers on this machine. "
        "Per-worker flags take one value for all workers or one per worker; every other flag goes to the "
        "scheduler (see python -m omnips.scheduler --help).")
    p.add_argument("--num-servers", type=int, default=None, help="default 1, or the resumed job's")
    p.add_argument("--num-workers", type=int, default=None, help="default 3, or the resumed job's")
    p.add_argument("--capacity", nargs="+", default=["1"], help="declared relative speed, per worker")
    p.add_argument("--slowdown", nargs="+", default=["1"], help="F or STEP:F,STEP:F schedule, per worker")
    p.add_argument("--emulate-ms-per-step", nargs="+", default=["0"], help="virtual device A ms, per worker")
    p.add_argument("--emulate-ms-per-sample", nargs="+", default=["0"], help="virtual device C ms, per worker")
    p.add_argument("--threads", nargs="+", default=["1"], help="torch threads, per worker")
    p.add_argument("--device", nargs="+", default=["cpu"], help="cpu, cuda, cuda:N or auto, per worker")
    p.add_argument("--run-dir", type=nonempty, default=None, help="default runs/YYYYmmdd-HHMMSS")
    p.add_argument("--resume", type=nonempty, default=None, metavar="RUN_DIR",
                   help="continue the interrupted run in RUN_DIR from its newest complete checkpoint")
    p.add_argument("--timeout", type=duration, default=24 * 3600.0, help="seconds before the job is stopped")
    p.add_argument("--no-progress", action="store_true", help="print no progress line")
    p.add_argument("--no-plots", action="store_true", help="do not draw RUN_DIR/plots at the end")
    add_security(p, listens=True)  # for every process
    add_transport(p)  # for the scheduler and every worker
    return p


def cluster_size(args, parser) -> None:
    """Settle --num-servers and --num-workers: as given, else the resumed job's, else 1 and 3."""
    job = resumed_job(args.resume, parser) if args.resume is not None else None
    if args.num_servers is None:
        args.num_servers = job.num_servers if job else 1
    if args.num_workers is None:
        args.num_workers = job.num_workers if job else 3


def resumed_job(run_dir: str, parser) -> JobSpec:
    """The job in RUN_DIR/config.json, read as the scheduler will read it."""
    from omnips.scheduler.checkpoints import ResumeError, saved_job
    try:
        return saved_job(run_dir)
    except ResumeError as exc:
        parser.error(f"--resume: {exc}")


def worker_specs(args, parser) -> list[WorkerSpec]:
    n = args.num_workers
    if n < 1 or args.num_servers < 1:
        parser.error("--num-workers and --num-servers must be >= 1")
    columns = {}
    for flag, (name, kind) in PER_WORKER.items():
        values = getattr(args, flag)
        if len(values) not in (1, n):
            parser.error(f"--{flag.replace('_', '-')} takes 1 or {n} values, not {len(values)}")
        try:
            columns[name] = [kind(v) for v in (values * n if len(values) == 1 else values)]
        except ValueError as exc:
            parser.error(f"--{flag.replace('_', '-')}: {exc}")
    return [WorkerSpec(**{name: col[i] for name, col in columns.items()}) for i in range(n)]


def check_job(args, scheduler_args, parser) -> None:
    """Refuse the scheduler's flags, and a new job that cannot work, as the scheduler would:
    it runs only after the run directory is made, and its refusal would end in a log."""
    from omnips.scheduler.__main__ import check_run_flags, job_from, parser as scheduler_parser
    a = borrowed_check(parser, "", scheduler_parser().parse_args, [
        *scheduler_args, "--num-servers", str(args.num_servers), "--num-workers", str(args.num_workers)])
    try:
        check_run_flags(a)
        if args.resume is None:  # a resumed job is config.json's, checked by resumed_job
            job_from(a)
    except ValueError as exc:
        parser.error(str(exc))


def check_workers(workers: list[WorkerSpec], parser) -> None:
    """Refuse what a worker would: it would exit at once, leaving the cluster waiting for it."""
    from omnips.worker.__main__ import parse
    from omnips.worker.trainer import check_device
    for rank, spec in enumerate(workers):
        borrowed_check(parser, f"worker {rank}: ", parse,
                       ["--scheduler", "tcp://127.0.0.1:0", "--rank", str(rank), *spec.args()])
        try:
            check_device(spec.device)
        except ValueError as exc:
            parser.error(f"worker {rank}: --device: {exc}")


def borrowed_check(parser, prefix: str, parse, argv):
    """`parse(argv)` with another role's parser, whose refusal becomes this parser's error
    line: that parser would print its own usage."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit:
        parser.error(prefix + err.getvalue().strip().rpartition(": error: ")[2])


def launch(argv) -> int:
    """start a scheduler, servers and workers on this machine and show the job's progress"""
    parser = launch_parser()
    args, scheduler_args = parser.parse_known_args(argv)
    cluster_size(args, parser)
    if args.resume is not None:
        if args.run_dir is not None and Path(args.run_dir).resolve() != Path(args.resume).resolve():
            parser.error(f"--run-dir {args.run_dir} differs from --resume {args.resume}")
        scheduler_args += ["--resume", args.resume]
    workers = worker_specs(args, parser)  # first: it refuses a cluster size that check_job would pass on
    check_job(args, scheduler_args, parser)
    check_workers(workers, parser)
    run_dir = Path(args.resume or args.run_dir or time.strftime("runs/%Y%m%d-%H%M%S"))
    if not args.resume and (run_dir / "metrics.jsonl").exists():
        parser.error(f"run directory {run_dir} already holds a run: choose another --run-dir")
    env = {"OMNIPS_TOKEN": args.token, "OMNIPS_TRANSPORT": args.transport}
    cluster = LocalCluster(run_dir, scheduler_args, args.num_servers, workers, env=env,
                           keys=args.keys.path if args.keys else None)
    # a supervisor's stop or a closed terminal: as Ctrl-C (the children, in their own process group, see none);
    # SIGINT itself too: a launcher started in the background of a script inherits it ignored
    handlers = {sig: signal.signal(sig, signal.default_int_handler)
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        cluster.start()
        if cluster.status_url:
            print(f"status page: {cluster.status_url}  (omnips status {cluster.status_url})", file=sys.stderr)
        show = Progress(run_dir, enabled=not args.no_progress)
        deadline = time.monotonic() + args.timeout
        while cluster.poll() is None:
            if time.monotonic() > deadline:
                raise LaunchError(f"the job did not finish within {args.timeout:g} s")
            show.update()
            time.sleep(0.5)  # refresh rate of the progress line
        show.update(final=True)
        code = cluster.wait(60)
    except LaunchError as exc:
        print(f"omnips launch: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(("\n" if sys.stderr.isatty() else "") + interrupted(run_dir, cluster), file=sys.stderr)
        return 130
    finally:
        cluster.stop(grace_s=0)  # nothing outlives the launcher
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    code = report(run_dir, code, cluster)
    if not args.no_plots:
        try:
            print(f"plots: {', '.join(str(p) for p in plot_run(run_dir))}")
        except PlotError as exc:
            print(f"plots skipped: {exc}", file=sys.stderr)
    return code


def interrupted(run_dir: Path, cluster: LocalCluster) -> str:
    """Stop the job through its scheduler (Ctrl-C, SIGTERM or SIGHUP to the launcher): one
    line saying what was stopped, where the run is and how to go on."""
    from omnips.scheduler.stopping import STOP_WAIT_S
    cluster.interrupt(STOP_WAIT_S + 10.0)  # the scheduler's own stop window, and time to write
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"status": "stopped before the job began"}
    status = summary["status"] + (f": {summary['stopped']}" if summary.get("stopped") else "")
    ckpts = run_dir / "checkpoints"
    go_on = (f"resume with: omnips launch --resume {run_dir}" if ckpts.is_dir() and any(ckpts.glob("*/manifest.json"))
             else "no checkpoint to resume from (--checkpoint-every STEPS writes them)")
    return f"omnips launch: {status}; run directory {run_dir}; {go_on}"


def report(run_dir: Path, code: int, cluster: LocalCluster) -> int:
    path = run_dir / "summary.json"
    if not path.exists():
        print(f"omnips launch: no summary written; scheduler log: {cluster.tail('scheduler')}", file=sys.stderr)
        return code or 1
    print(summary_table(json.loads(path.read_text())))
    print(f"run directory: {run_dir}")
    preempted = code == PREEMPTED_EXIT  # the others exit so too: no failure
    failed = {name: c for name, c in cluster.exit_codes().items() if c not in (0, PREEMPTED_EXIT if preempted else 0)}
    for name in failed:
        print(f"{name} exited with {failed[name]}: {cluster.tail(name, 2)}", file=sys.stderr)
    return code or (1 if failed else 0)


def summary_table(s: dict) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, list):
            return " ".join(fmt(x) for x in v)
        return str(v)
    width = max(len(k) for k in s)
    return "\n".join(f"{k:<{width}}  {fmt(v)}" for k, v in s.items())


class Progress:
    """A one-line view of metrics.jsonl: epoch, samples/s over the last seconds, test accuracy."""

    def __init__(self, run_dir: Path, enabled: bool = True, out=sys.stderr):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.out = out
        self._offset = 0
        self.budget_epochs = None
        self.epoch = 0.0
        self.accuracy = None
        self.diverged: str | None = None  # the scheduler's hint, once it finds the job diverged
        self.waits: str | None = None  # what a stalled step waits for, while it does (a `wait` event)
        self._window: list[tuple[float, int]] = []  # (t, batch) of recent steps
        self._progress: list[tuple[float, float]] = []  # (t, epoch) over the ETA's window
        self._printed = 0.0

    def _read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self._offset)
            for line in f:
                if not line.endswith("\n"):
                    break  # written half; read it next time
                self._offset += len(line)
                e = json.loads(line)
                if e["event"] == "start":
                    self.budget_epochs = e["budget_epochs"]
                elif e["event"] == "step":
                    self.epoch = e["epoch"]
                    self._window.append((e["t"], e["batch"]))
                    self._progress.append((e["t"], e["epoch"]))
                elif e["event"] == "eval":
                    self.accuracy = e["test_accuracy"]
                elif e["event"] == "diverged":
                    self.diverged = e["hint"]
                elif e["event"] == "recovered":
                    self.diverged = None
                elif e["event"] == "wait":
                    self.waits = wait_text(e)

    def line(self) -> str:
        recent = [w for w in self._window if w[0] >= self._window[-1][0] - 5.0] if self._window else []
        self._window = recent
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(b for _, b in recent[1:]) / span if span > 0 else 0.0
        total = self.budget_epochs
        self._progress = [p for p in self._progress if p[0] >= self._progress[-1][0] - ETA_WINDOW_S] \
            if self._progress else []
        eta = eta_s([(t, epoch / total) for t, epoch in self._progress]) if total else None
        bar = "#" * int(min(1.0, self.epoch / total) * 30) if total else ""
        budget = f"{round(total, 4):g}" if total else "?"  # "?" until the scheduler's start event
        acc = f"{self.accuracy:.3f}" if self.accuracy is not None else "-"
        warning = f"  DIVERGED: {self.diverged}" if self.diverged else ""
        warning += f"  {self.waits}" if self.waits else ""
        return (f"[{bar:<30}] epoch {self.epoch:6.2f}/{budget}  {rate:8.0f} samples/s  ETA {readable(eta):>6}  "
                f"test acc {acc}{warning}")

    def update(self, final: bool = False) -> None:
        if not self.enabled:
            return
        self._read()
        if self.out.isatty():
            print("\r" + self.line(), end="\n" if final else "", file=self.out, flush=True)
        elif final or time.monotonic() - self._printed >= 10.0:  # a log: one line per 10 s
            self._printed = time.monotonic()
            print(self.line(), file=self.out, flush=True)


def plot(argv) -> int:
    """draw a run directory's PNGs into RUN_DIR/plots"""
    p = argparse.ArgumentParser(prog="omnips plot", allow_abbrev=False,
                                description="Draw PNGs of a run directory into RUN_DIR/plots.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    try:
        for path in plot_run(args.run_dir):
            print(path)
    except PlotError as exc:
        print(f"omnips plot: {exc}", file=sys.stderr)
        return 1
    return 0


def export(argv) -> int:
    """write a run's metrics in another format: omnips export tensorboard RUN_DIR"""
    p = argparse.ArgumentParser(prog="omnips export", allow_abbrev=False,
                                description="Write a run directory's metrics in another format.")
    p.add_argument("format", choices=["tensorboard"])
    p.add_argument("run_dir", type=nonempty)
    p.add_argument("--out", type=nonempty, default=None, metavar="DIR",
                   help="the TensorBoard log directory (default RUN_DIR/tensorboard)")
    args = p.parse_args(argv)
    from .scalars import ScalarsError, export as export_scalars
    try:
        print(export_scalars(args.run_dir, args.out))
    except ScalarsError as exc:
        print(f"omnips export: {exc}", file=sys.stderr)
        return 1
    return 0


def keygen(argv) -> int:
    """make the CURVE keys for --keys (or add one machine's key)"""
    p = argparse.ArgumentParser(prog="omnips keygen", allow_abbrev=False,
                                description="Make the CURVE keys for --keys: a server pair, "
                                "a client pair and the allow-list DIR/authorized/. With --client NAME, add a key "
                                "for one machine instead: DIR/clients/NAME (copy it there and use it as --keys) "
                                "and its public key in DIR/authorized/NAME.key (delete it to shut that machine out).")
    p.add_argument("dir", type=nonempty)
    p.add_argument("--client", type=nonempty, metavar="NAME", help="add a client key for one machine to the keys in DIR")
    args = p.parse_args(argv)
    try:
        if args.client is not None:
            print(f"client keys for {args.client} in {security.keygen_client(args.dir, args.client)}; "
                  f"its public key is allowed in {Path(args.dir) / 'authorized'}")
        else:
            security.keygen(args.dir)
            print(f"keys in {args.dir}: start every process with --keys {args.dir} (keep it private: it holds "
                  "secret keys)")
    except security.KeysError as exc:
        print(f"omnips keygen: {exc}", file=sys.stderr)
        return 1
    return 0


def _cluster(name: str, doc: str):
    """`omnips slurm` and `omnips k8s` print a job for a cluster manager (omnips/slurm.py, omnips/k8s.py)."""
    def run(argv) -> int:
        import importlib
        return importlib.import_module(f"omnips.{name}").main(argv)
    run.__doc__ = doc  # the usage's line for it
    return run


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .status_view import main as status
    commands = {"launch": launch, "status": status, "plot": plot, "export": export, "keygen": keygen,
                "slurm": _cluster("slurm", "print an sbatch script that runs the job on Slurm"),
                "k8s": _cluster("k8s", "print Kubernetes manifests that run the job")}
    if not argv or argv[0] not in commands:
        return usage(commands, argv[0] if argv else None)
    return commands[argv[0]](argv[1:])


def usage(commands: dict, given: str | None) -> int:
    """The subcommands, one line each (from their docstrings); exit 0 for --help, else 2."""
    width = max(map(len, commands))
    lines = [f"  {name:<{width}}  {''.join((fn.__doc__ or '').strip().splitlines()[:1])}"
             for name, fn in commands.items()]
    text = "usage: omnips COMMAND [options]   (omnips COMMAND --help for its options)\n\ncommands:\n" + "\n".join(lines)
    if given in ("-h", "--help"):
        print(text)
        return 0
    print((f"omnips: unknown command {given}\n" if given else "") + text, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
