"""Start a whole cluster on this machine: one scheduler, S servers, N workers, as processes.

Used by `omnips launch` / scripts/launch_local.py, by the end-to-end tests and by
the benchmarks. Each child gets the allocator settings of transport.MALLOC_ENV and
logs to RUN_DIR/logs/. The scheduler binds port 0 and prints its address, which
the other processes are then given. Children run in their own process group: a
terminal's Ctrl-C reaches the launcher alone, which stops the job through the
scheduler (interrupt), so that the run directory is written to its end.
"""

import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .transport import MALLOC_ENV

_ENDPOINT = re.compile(r"listening on (tcp://\S+)")
_STATUS = re.compile(r"status page on (http://\S+)")  # printed before the address


class LaunchError(RuntimeError):
    pass


def read_endpoint(stream, timeout_s: float) -> str | None:
    """The address a starting scheduler prints on `stream` (its stdout pipe), or None if
    it exits or stays silent for `timeout_s`."""
    return read_announcements(stream, timeout_s)[0]


def read_announcements(stream, timeout_s: float) -> tuple[str | None, str | None]:
    """(the scheduler's address, its status page's URL or None) as read_endpoint finds them.
    Reads the raw descriptor: a buffered readline could hold a second line back from select()."""
    deadline = time.monotonic() + timeout_s
    fd, seen = stream.fileno(), b""
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return None, None
            chunk = os.read(fd, 4096)
            if not chunk:  # the scheduler exited before listening
                return None, None
            seen += chunk
            text = seen.decode(errors="replace")
            match = _ENDPOINT.search(text)
            if match:
                status = _STATUS.search(text)
                return match.group(1), status.group(1) if status else None
    return None, None


def _drain(stream, path: Path) -> None:
    """Copy what the scheduler prints after its address into its log, so that a
    chatty user model can never fill the pipe and block it."""
    with open(path, "ab") as log:
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            log.write(chunk)
            log.flush()


@dataclass(frozen=True)
class WorkerSpec:
    """Command-line facts about one worker's machine."""

    capacity: float = 1.0
    slowdown: str = "1"
    ms_per_step: float = 0.0
    ms_per_sample: float = 0.0
    threads: int = 1
    device: str = "cpu"
    extra: tuple[str, ...] = ()

    def args(self) -> list[str]:
        return ["--capacity", str(self.capacity), "--slowdown", self.slowdown,
                "--emulate-ms-per-step", str(self.ms_per_step), "--emulate-ms-per-sample", str(self.ms_per_sample),
                "--threads", str(self.threads), "--device", self.device, *self.extra]


@dataclass
class LocalCluster:
    run_dir: Path
    scheduler_args: list[str]
    num_servers: int
    workers: list[WorkerSpec]
    server_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)  # e.g. OMNIPS_TOKEN, which unlike a flag stays out of ps
    keys: Path | None = None  # --keys for every process (a worker's own --keys in its extra wins)
    ranks: int | None = None  # worker ranks (--num-workers); default: one per worker started now
    procs: dict = field(default_factory=dict)  # name -> Popen
    endpoint: str | None = None
    status_url: str | None = None  # the scheduler's status page, unless --status-port off
    # copies the scheduler's stdout into logs/scheduler.out (stop() waits for it)
    _drainer: threading.Thread | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self.run_dir = Path(self.run_dir)
        made = [d for d in (self.run_dir, *self.run_dir.parents) if not d.exists()]
        self._made = made[-1] if made else None  # the outermost folder made here: a failed start removes it
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, module: str, args: list[str], stdout=None) -> subprocess.Popen:
        env = {**os.environ, **MALLOC_ENV, "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.run_dir / "logs" / f"{name}.log", "a")  # a resumed run's processes continue its logs
        proc = subprocess.Popen([sys.executable, "-m", module, *args], env=env, stdin=subprocess.DEVNULL,
                                stdout=stdout or log, stderr=log, process_group=0)
        log.close()
        self.procs[name] = proc
        return proc

    def start(self, timeout_s: float = 60.0) -> "LocalCluster":
        self.start_scheduler(timeout_s)
        self.start_servers()
        self.start_workers()
        return self

    # start() in three stages, so that a test can act while the cluster is incomplete
    def start_scheduler(self, timeout_s: float = 60.0) -> None:
        sched = self._spawn("scheduler", "omnips.scheduler", [
            *self.scheduler_args, *self._keys(), "--num-servers", str(self.num_servers),
            "--num-workers", str(self.ranks or len(self.workers)), "--port", "0", "--run-dir", str(self.run_dir)],
            stdout=subprocess.PIPE)
        self.endpoint = self._read_endpoint(sched, timeout_s)
        self._drainer = threading.Thread(target=_drain, args=(sched.stdout, self.run_dir / "logs" / "scheduler.out"),
                                         daemon=True)
        self._drainer.start()

    def start_servers(self) -> None:
        for s in range(self.num_servers):
            self.start_server(f"server{s}", rank=s)  # asked for: serverS.log is server S's

    def start_server(self, name: str, rank: int = -1) -> None:
        """A server with the cluster's command line (also one that takes a lost server's shard)."""
        self._spawn(name, "omnips.server", ["--scheduler", self.endpoint, "--rank", str(rank), *self._keys(),
                                     *self.server_args])

    def start_workers(self) -> None:
        for i, w in enumerate(self.workers):
            self.add_worker(w, i)

    def _keys(self) -> list[str]:
        return ["--keys", str(self.keys)] if self.keys is not None else []

    def add_worker(self, spec: WorkerSpec, rank: int, name: str | None = None) -> str:
        """Start a worker asking for `rank` (also into a running job, where the rank is vacant)."""
        name = name or f"worker{rank}"
        self._spawn(name, "omnips.worker", ["--scheduler", self.endpoint, "--rank", str(rank), *self._keys(), *spec.args()])
        return name

    def _read_endpoint(self, proc: subprocess.Popen, timeout_s: float) -> str:
        endpoint, self.status_url = read_announcements(proc.stdout, timeout_s)
        if endpoint is None:
            self.stop()
            tail = self.tail("scheduler")
            if self._made is not None and not (self.run_dir / "config.json").exists():
                shutil.rmtree(self._made, ignore_errors=True)  # no run began: leave none behind
                raise LaunchError(f"the scheduler did not start: {tail}")
            raise LaunchError(f"the scheduler did not start (see {self.run_dir / 'logs' / 'scheduler.log'}): {tail}")
        return endpoint

    def tail(self, name: str, lines: int = 5) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return " | ".join(text[-lines:])

    def poll(self) -> int | None:
        """The scheduler's exit code once it has exited, else None."""
        return self.procs["scheduler"].poll()

    def wait(self, timeout_s: float) -> int:
        """Wait for the scheduler, then give the others a moment to exit; returns the
        scheduler's exit code. Raises LaunchError (and stops everything) on timeout."""
        try:
            code = self.procs["scheduler"].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise LaunchError(f"the job did not finish within {timeout_s:g} s") from None
        self.stop(grace_s=15.0)
        return code

    def interrupt(self, wait_s: float) -> int | None:
        """Stop the job as a Ctrl-C does: one SIGINT to the scheduler, which has the workers
        stop and writes the model, a checkpoint and its summary; wait up to `wait_s` for it,
        then for the others it told to exit. A second KeyboardInterrupt meanwhile is passed
        on (the scheduler then ends at once). Returns the scheduler's exit code, None if it
        had to be killed."""
        sched = self.procs.get("scheduler")
        code = None
        if sched is not None and sched.poll() is None:
            sched.send_signal(signal.SIGINT)
            deadline = time.monotonic() + wait_s
            while code is None and time.monotonic() < deadline:
                try:
                    code = sched.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
                except KeyboardInterrupt:
                    sched.send_signal(signal.SIGINT)
        elif sched is not None:
            code = sched.returncode
        self.stop(grace_s=15.0)
        return code

    def exit_codes(self) -> dict[str, int | None]:
        return {name: p.poll() for name, p in self.procs.items()}

    def stop(self, grace_s: float = 5.0) -> None:
        """Wait up to `grace_s` for every process to exit, then terminate, then kill."""
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        if self._drainer is not None:  # its pipe ends with the scheduler: then logs/ holds no open file
            self._drainer.join(timeout=5)


    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(grace_s=0.0)
