"""A real Slurm on loopback for tests: Debian's slurmctld and one slurmd per emulated node,
run from the directory scripts/slurm_fetch.sh unpacks them into (nothing installed).
Every daemon runs in the foreground as this test's child and is stopped by its PID."""

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("OMNIPS_SLURM_CACHE", Path.home() / ".cache" / "omnips-slurm"))
LIB = "usr/lib/x86_64-linux-gnu"


class SlurmUnavailable(RuntimeError):
    pass


def fetch() -> Path:
    """The unpacked Slurm, fetched with apt-get where it is not there yet."""
    root = CACHE / "root"
    if not (root / "usr/sbin/slurmctld-wlm").exists():
        if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
            raise SlurmUnavailable("no apt-get/dpkg here to fetch Debian's Slurm packages")
        out = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_fetch.sh"), str(CACHE)], capture_output=True,
                             text=True, timeout=600)
        if out.returncode != 0:
            raise SlurmUnavailable(f"scripts/slurm_fetch.sh failed: {out.stderr.strip()[-500:]}")
    return root


def free_ports(n: int) -> list[int]:
    """Ports free just now, for daemons that take fixed ports (Slurm's take theirs from
    slurm.conf only, and cannot bind port 0 and report it); holding all n sockets open until
    each is read keeps the n distinct."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    """slurmctld and `nodes` slurmd, each node NodeAddr 127.0.0.1 with its own port and
    `cpus` CPUs (the backfill scheduler places each heterogeneous component on a node of its own)."""

    def __init__(self, workdir: Path, nodes: int = 3, cpus: int = 4):
        self.root = fetch()
        self.dir = Path(workdir)
        self.names = [f"n{i}" for i in range(nodes)]
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        lib = self.root / LIB
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf"),
                    "LD_LIBRARY_PATH": f"{lib}:{lib / 'slurm-wlm'}",
                    "PATH": f"{self.root / 'usr/bin'}:{os.environ['PATH']}"}

    def write_conf(self) -> None:
        ctld, slurmd, *node_ports = free_ports(2 + len(self.names))
        user = getpass.getuser()
        for sub in ("state", "spool", "logs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=omnips", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={ctld}",
            f"SlurmdPort={slurmd}", f"SlurmUser={user}", f"SlurmdUser={user}",
            # cred_expire: a requeued job waits this long (+1 s) before it may start again (default 120)
            "AuthType=auth/none", "AuthInfo=cred_expire=5", "CredType=cred/none", "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "SlurmdParameters=config_overrides", "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "MpiDefault=none",
            "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "MinJobAge=600", "KillWait=5",
            f"PluginDir={self.root / LIB / 'slurm-wlm'}", f"StateSaveLocation={self.dir / 'state'}",
            f"SlurmdSpoolDir={self.dir / 'spool' / '%n'}", f"SlurmctldPidFile={self.dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.dir / 'slurmd-%n.pid'}", f"SlurmctldLogFile={self.dir / 'logs' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.dir / 'logs' / 'slurmd-%n.log'}",
        ]
        for name, port in zip(self.names, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname=localhost Port={port} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        lines.append(f"PartitionName=cpu Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        (self.dir / "slurm.conf").write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 60.0) -> "SlurmCluster":
        self.write_conf()
        sbin = self.root / "usr/sbin"
        self._spawn([sbin / "slurmctld-wlm", "-D", "-i"], "slurmctld")
        for name in self.names:
            (self.dir / "spool" / name).mkdir(exist_ok=True)
            # -d: where slurmstepd is (the binary's built-in path is /usr/sbin's)
            self._spawn([sbin / "slurmd-wlm", "-D", "-N", name, "-d", sbin / "slurmstepd-wlm"], f"slurmd-{name}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.cmd("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if len(states) == len(self.names) and all(s == "idle" for s in states.values()):
                return self
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: {self.log_tail()}")
            time.sleep(0.5)  # the nodes register with slurmctld
        raise RuntimeError(f"Slurm's nodes not idle within {timeout_s:g} s: {states}; {self.log_tail()}")

    def _spawn(self, argv, name: str) -> None:
        log = open(self.dir / "logs" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen([str(a) for a in argv], env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()

    def cmd(self, *argv, check: bool = True, timeout: float = 30.0, cwd=None) -> subprocess.CompletedProcess:
        out = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {out.returncode}: {out.stderr.strip()}")
        return out

    def job_state(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields of the job (component 0 of a heterogeneous one)."""
        out = self.cmd("scontrol", "show", "job", "-o", job_id).stdout.splitlines()[0]
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, timeout_s: float, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                "NODE_FAIL", "OUT_OF_MEMORY")) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state["JobState"] in until:
                return state
            time.sleep(1.0)  # slurmctld's view changes in steps of a second or more
        raise TimeoutError(f"job {job_id} still {state['JobState']} after {timeout_s:g} s")

    def log_tail(self, lines: int = 8) -> str:
        return " | ".join(line for p in sorted((self.dir / "logs").glob("*"))
                          for line in p.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Cancel every job, then stop each daemon this cluster started (by its PID)."""
        if self.procs and self.procs[0].poll() is None:
            self.cmd("scancel", "--user", getpass.getuser(), check=False)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.cmd("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.5)
        for p in reversed(self.procs):  # the nodes, then slurmctld
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

