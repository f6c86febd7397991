"""CPU quotas for benchmark processes: a cgroup per worker, its CPU time capped at a share of
one core (cgroup v1 `cpu.cfs_quota_us` under /sys/fs/cgroup/cpu, or v2 `cpu.max` where
the unified hierarchy offers cpu quotas: "cpu" in its cgroup.controllers). Needs root. The paper made its
heterogeneity levels the same way, with container CPU limits.

    with CpuQuota("omnips-w0", 0.25) as q:   # a quarter of a core
        q.add(pid)                           # the process and the threads it starts later
        q.set(0.125)                         # halved for a while
        q.throttled()                        # periods in which it ran out of quota
"""

import math
import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # short periods: a step of tens of ms spans several, so a quota slows it smoothly
MIN_QUOTA_US = 1_000  # the kernel's least quota a period: a smaller share lengthens the period instead


class QuotaError(RuntimeError):
    pass


def _v2() -> bool:
    offered = V2 / "cgroup.controllers"  # (the kernel's name for what a cgroup can limit)
    return offered.exists() and "cpu" in offered.read_text().split()


def available() -> str | None:
    """None where CPU quotas can be set here, else why not."""
    if os.geteuid() != 0:
        return "CPU quotas need root"
    if not (V1 / "cpu.cfs_quota_us").exists() and not _v2():
        return f"no cgroup cpu quotas at {V1} (v1) or {V2} (v2)"
    try:
        with CpuQuota(f"omnips-probe-{os.getpid()}", 0.5):
            pass
    except (OSError, QuotaError) as exc:
        return f"cannot make a cgroup: {exc}"
    return None


class CpuQuota:
    """A cgroup of its own, named `name`, capped at `cores` (a share of one core, or more)."""

    def __init__(self, name: str, cores: float):
        self.v2 = not (V1 / "cpu.cfs_quota_us").exists()
        self.path = (V2 if self.v2 else V1) / name
        self.cores = cores

    def __enter__(self) -> "CpuQuota":
        if self.v2:
            (V2 / "cgroup.subtree_control").write_text("+cpu")
        self.path.mkdir()
        try:
            self.set(self.cores)
        except OSError:
            self.path.rmdir()
            raise
        return self

    def set(self, cores: float) -> None:
        """Cap the group at `cores`: PERIOD_US periods, or longer ones where the quota of one
        would fall below MIN_QUOTA_US (under a tenth of a core)."""
        period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / cores))
        quota = round(cores * period)
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        self.cores = cores

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> int:
        """Periods in which the group ran out of quota, so far."""
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "nr_throttled":
                return int(value)
        raise QuotaError(f"no nr_throttled in {self.path / 'cpu.stat'}")

    def __exit__(self, *exc) -> None:
        """Move what is left in the group to the root group, then remove it."""
        root = (V2 if self.v2 else V1) / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                root.write_text(pid)
            except OSError:  # it has exited meanwhile
                pass
        self.path.rmdir()
