"""How many torch threads a worker takes when --threads is not given.

torch's default is one thread per core, right for a process alone on its host; three
workers started by hand on one 2-core host then each ran 2 threads on 2 cores and
computed 17x slower per step than with one thread each (what `omnips launch` gives).
A worker learns from its welcome how many workers of its job share its host (the
scheduler's cluster map: every worker names its host when it registers, and the start
waits for all of them) and takes an equal share of the cores it may run on."""

import math
import os

from .quota import cpu_quota


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroups' CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def share(cores: int, workers_here: int) -> int:
    """An equal share of `cores` among `workers_here` workers, at least one thread."""
    return max(1, cores // max(1, workers_here))
