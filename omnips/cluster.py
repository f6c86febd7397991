"""What a welcome tells a server or a worker besides the job (omnips/job.py): the cluster
map every process gets, and what a server or a worker starts from. Records inside a
`Welcome` (omnips/protocol.py), checked once where the codec decodes them; past it a
process reads their fields as they are."""

from dataclasses import dataclass

from .batching import BatchPlan
from .fieldchecks import MAX_SECONDS, brief, count, local_endpoints_ok, non_negative
from .sharding import shard_ranges


@dataclass(frozen=True)
class ClusterMap:
    """The servers: each one's shard of the flat vector of `num_params` values, its tcp
    endpoint and its [hostname, ipc endpoint or ""] (omnips/routes.py); and how often the
    scheduler and the processes hear from each other."""

    num_params: int
    ranges: tuple[tuple[int, int], ...]  # [lo, hi) of server s's shard, as omnips.sharding splits them
    servers: tuple[str, ...]
    dead_after_s: float  # a peer silent this long is taken for lost
    heartbeat_s: float
    ipc: tuple[tuple[str, str], ...] = ()  # none: a scheduler that knows no unix sockets (tcp only)

    def check(self):
        non_negative(self, "num_params")
        if not self.ranges or list(self.ranges) != shard_ranges(self.num_params, len(self.ranges)):
            raise ValueError(f"ranges {brief(self.ranges)} are not the shards of num_params {self.num_params} over "
                             f"{len(self.ranges)} servers")
        if len(self.servers) != len(self.ranges):
            raise ValueError(f"servers: {len(self.servers)} endpoints for {len(self.ranges)} shard ranges")
        if not local_endpoints_ok(self.ipc, self.servers):
            raise ValueError("ipc must hold one [host, ipc:// endpoint or \"\"] pair per server, or none")
        for name in ("dead_after_s", "heartbeat_s"):
            if not 0 < getattr(self, name) <= MAX_SECONDS:
                raise ValueError(f"{name} must be above 0 and at most {MAX_SECONDS:g} s, not {getattr(self, name)}")


@dataclass(frozen=True)
class ServerStart:
    """A server's start: the shard's first `num_trained` values are parameters (the rest
    buffers the optimizer leaves alone), checkpoints go to `checkpoint_dir`, and with
    `restore` it continues from that checkpoint (a resumed job, or a lost server's shard)."""

    num_trained: int
    checkpoint_dir: str
    restore: str = ""

    def check(self):
        non_negative(self, "num_trained")


@dataclass(frozen=True)
class WorkerStart:
    """A worker's start: the plan in force, the job's BSP steps, and where it starts.
    `join_gen` >= 0: it joins a running job at the first step of that plan (BSP) or at
    `step` (ASP, SSP); `resumed`: the servers restored a checkpoint and it goes on from
    `step` and sample `position`."""

    plan: BatchPlan
    total_steps: int
    join_gen: int = -1
    resumed: bool = False
    step: int = 0
    position: int = 0
    host_workers: int = 1  # the job's workers on its host, itself included: they share its cores
    fingerprints: dict | None = None  # the scheduler's digests of the model and data set; None: unsaid

    def check(self):
        non_negative(self, "total_steps", "step", "position")
        if self.join_gen < -1:
            raise ValueError(f"join_gen must be >= 0 (or -1: there from the start), not {self.join_gen}")
        if not (count(self.host_workers) and self.host_workers >= 1):
            raise ValueError(f"host_workers must be >= 1, not {self.host_workers}")
