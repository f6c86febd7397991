"""Emulated hosts on one machine, for end-to-end tests across machines.

Each host is a network namespace with one interface, eth0, at 10.77.0.N/24, plugged
into a bridge that lives in a namespace of its own (the switch): nothing is added to
the machine's own network, and parallel tests (pytest-xdist) each get their own
switch, so the same addresses never meet. Every process on a host also runs in its
own mount and UTS namespaces (`unshare --mount --uts`): its own host name and a
private tmpfs as TMPDIR, so that a unix socket on one host cannot be opened from
another, and only TCP connects them. The run directory (outside TMPDIR) is seen by
every host at the same path: the shared file system that checkpoints need.

Namespace names carry the test process's pid and a counter. `close` ends every
process started here (by PID), then deletes the namespaces, which takes the veths and
the bridge with them, whatever happened before.
"""

import itertools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from omnips.launch import read_endpoint

SUBNET = "10.77.0"
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
_count = itertools.count()


class HostsRefused(RuntimeError):
    """This machine does not let us make namespaces (not root, no `ip`, a sandbox)."""


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise subprocess.CalledProcessError(out.returncode, ["ip", *args], out.stdout, out.stderr)


class Hosts:
    def __init__(self, names: list[str], tmp: Path):
        self.names = list(names)
        self.tag = f"omnips-{os.getpid()}-{next(_count)}"
        self.switch = f"{self.tag}-sw"
        self.tmp = Path(tmp) / "hosts-tmp"  # every host mounts its own tmpfs here
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, in the order made

    # -- the network --------------------------------------------------------------
    def create(self) -> "Hosts":
        if shutil.which("ip") is None or shutil.which("unshare") is None:
            raise HostsRefused("`ip` (iproute2) and `unshare` (util-linux) are needed")
        try:
            self._netns(self.switch)
        except subprocess.CalledProcessError as exc:
            raise HostsRefused(f"`ip netns add` refused: {exc.stderr.strip()} (root, or CAP_SYS_ADMIN, is needed)")
        try:
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = self.netns(name)
                self._netns(ns)
                # made inside the switch, its peer straight into the host: no name in the machine's namespace
                _ip("-n", self.switch, "link", "add", self._port(name), "type", "veth", "peer", "name", "eth0",
                    "netns", ns)
                _ip("-n", self.switch, "link", "set", self._port(name), "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self.tmp.mkdir(parents=True, exist_ok=True)
        except BaseException:
            self.close()
            raise
        return self

    def _netns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def netns(self, name: str) -> str:
        return f"{self.tag}-{self.names.index(name)}"

    def _port(self, name: str) -> str:
        return f"p{self.names.index(name)}"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def link(self, name: str, up: bool) -> None:
        """Plug host `name`'s cable into the switch, or pull it: its packets go nowhere."""
        _ip("-n", self.switch, "link", "set", self._port(name), "up" if up else "down")

    # -- processes ----------------------------------------------------------------
    def popen(self, name: str, argv: list[str], log: Path, env: dict | None = None, **kw) -> subprocess.Popen:
        """argv run on host `name` (its PID is argv's own: every wrapper execs), its output to `log`."""
        script = 'mount -t tmpfs -o size=64m,mode=1777 tmpfs "$TMPDIR" && hostname "$1" && shift && exec "$@"'
        env = {**os.environ, **(env or {}), "TMPDIR": str(self.tmp)}
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns(name), "unshare", "--mount", "--uts",
                                     "sh", "-c", script, "sh", name, *argv],
                                    env=env, stdin=subprocess.DEVNULL, stdout=kw.pop("stdout", out), stderr=out, **kw)
        self.procs.append(proc)
        return proc

    def run(self, name: str, argv: list[str]) -> str:
        """argv's output on host `name` (no tmpfs: for a look at the host, e.g. `hostname`)."""
        return subprocess.run(["ip", "netns", "exec", self.netns(name), *argv], capture_output=True, text=True,
                              timeout=30, check=True).stdout

    def close(self) -> None:
        """Every process started here ended (by PID), then every namespace deleted."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            # any process left in it is one of ours (a child of one above): by its PID
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class HostJob:
    """One omnips job spread over `hosts`, each role started by hand as docs/operations.md
    says (scripts/start-*.sh, `--host 0.0.0.0`, servers `--advertise` their address); logs
    in RUN_DIR/logs/NAME.log."""

    def __init__(self, hosts: Hosts, run_dir: Path, env: dict | None = None):
        self.hosts, self.run_dir = hosts, Path(run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.env = {"OMNIPS_PYTHON": sys.executable, **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.endpoint: str | None = None

    def _start(self, name: str, host: str, script: str, args: list[str], **kw) -> subprocess.Popen:
        proc = self.hosts.popen(host, ["bash", str(SCRIPTS / script), *args], self.log(name), self.env, **kw)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def scheduler(self, host: str, args: list[str], timeout_s: float = 150.0) -> str:
        """The scheduler on `host`, bound to every address there; its address for the others."""
        proc = self._start("scheduler", host, "start-scheduler.sh",
                           [*args, "--host", "0.0.0.0", "--port", "0", "--run-dir", str(self.run_dir)],
                           stdout=subprocess.PIPE)
        bound = read_endpoint(proc.stdout, timeout_s)
        if bound is None:
            raise AssertionError(f"the scheduler did not start: {self.log('scheduler').read_text()[-2000:]}")
        threading.Thread(target=_copy, args=(proc.stdout, self.run_dir / "logs" / "scheduler.out"),
                         daemon=True).start()
        self.endpoint = f"tcp://{self.hosts.address(host)}:{bound.rsplit(':', 1)[1]}"
        return self.endpoint

    def server(self, name: str, host: str, args: list[str] = ()) -> subprocess.Popen:
        return self._start(name, host, "start-server.sh", ["--scheduler", self.endpoint, "--host", "0.0.0.0",
                                                           "--advertise", self.hosts.address(host), *args])

    def worker(self, name: str, host: str, args: list[str] = ()) -> subprocess.Popen:
        return self._start(name, host, "start-worker.sh", ["--scheduler", self.endpoint, *args])

    def wait(self, timeout_s: float) -> dict[str, int]:
        """Every process's exit code, once the scheduler has ended and the others with it."""
        deadline = time.monotonic() + timeout_s
        return {name: proc.wait(timeout=max(1.0, deadline - time.monotonic())) for name, proc in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted((self.run_dir / "logs").glob("*.log")))


def _copy(stream, path: Path) -> None:
    """What the scheduler prints after its address, into a file: its pipe never fills."""
    with open(path, "ab") as out:
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            out.write(chunk)
