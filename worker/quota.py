"""The CPU quota a worker runs under (a container's CPU limit, a cgroup's), and the pace it sets.

A quota of q cores lets the process's threads use q seconds of CPU per second, granted per
period (100 ms by default, 10 ms in benchmarks/cgroup.py): a pass that needs C seconds of
CPU takes C/q seconds when repeated back to back, but a single short pass takes whatever
its periods give it. Run within what is left of a period's budget it is faster than C/q, and
run out of budget near its end it waits for the next. The probe's passes are a few periods
long: under a quota of 0.125 cores in 10-ms periods, a worker's 4-sample passes took 0.145 s
in both rounds where back to back they took 0.20 s, and the line through its passes gave it
56 samples where its quota called for 32. (omnips/batching.py's probe_times keeps the
fastest pass, which drops a pass that waited but keeps one that ran on unspent budget.)
"""

import os
from pathlib import Path

PROC = Path("/proc/self")


def cpu_quota(proc: Path = PROC) -> float | None:
    """The cores of CPU time this process's cgroups allow it: the least over its cgroup
    and the ones above it, in v1's cpu hierarchy or in v2's. None where none is set (or where the
    cgroup files cannot be read, as on hosts without cgroups)."""
    try:
        dirs = cgroup_dirs((proc / "cgroup").read_text(), (proc / "mountinfo").read_text())
        limits = [limit for limit in (_limit(d) for d in dirs) if limit is not None]
    except (OSError, ValueError):
        return None
    return min(limits, default=None)


def cgroup_dirs(cgroup: str, mountinfo: str) -> list[Path]:
    """The directories of this process's cpu cgroup and of those above it, up to its mount's
    root, from `/proc/self/cgroup` and `/proc/self/mountinfo` (their texts). A v1 cpu hierarchy
    is taken before v2's unified one, where both are mounted (v1 then holds the cpu controller)."""
    paths = {}
    for line in cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            paths.setdefault("cgroup2", path)
        elif "cpu" in controllers.split(","):
            paths["cgroup"] = path
    for kind in ("cgroup", "cgroup2"):
        if kind not in paths:
            continue
        for line in mountinfo.splitlines():
            fields = line.split()
            tail = fields[fields.index("-") + 1:]  # the filesystem type, its source, its options
            if tail[0] != kind or (kind == "cgroup" and "cpu" not in tail[2].split(",")):
                continue
            root, point = fields[3], Path(fields[4])  # the cgroup at the mount point, where it is mounted
            inside = os.path.relpath(paths[kind], root)
            if inside.startswith(".."):
                continue  # this mount shows another part of the tree
            here = point / inside if inside != "." else point
            return [here, *[p for p in here.parents if p.is_relative_to(point)]]
    return []


def _limit(directory: Path) -> float | None:
    v2 = directory / "cpu.max"  # "QUOTA PERIOD", or "max PERIOD": no limit
    if v2.exists():
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    v1 = directory / "cpu.cfs_quota_us"  # -1: no limit
    if v1.exists():
        quota = int(v1.read_text())
        return None if quota < 0 else quota / int((directory / "cpu.cfs_period_us").read_text())
    return None


def paced(wall_s: float, cpu_s: float, quota: float | None) -> float:
    """A pass's time as passes repeated back to back would take it: its wall time, or its CPU
    time at the quota's rate where that is longer (the pass used more than its quota's share,
    as it can when a period's budget is still unspent). That can only add time, so a pass slowed
    by other processes keeps its wall time."""
    return wall_s if quota is None else max(wall_s, cpu_s / quota)


def pacing(device_type: str, quota: float | None) -> float | None:
    """The quota that paces probe passes on a device of `device_type`: a CPU's only. A GPU's
    passes run on the device, and the CPU time its waits spin, taken at the quota's rate, would
    stretch them by up to 1/quota (the scheduler, likewise, shapes only CPU workers' probe
    lines by their quota: scheduler/planning.py)."""
    return quota if device_type == "cpu" else None
