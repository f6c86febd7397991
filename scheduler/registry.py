"""Rendezvous: who has registered, their ranks, and the welcomes once the cluster is whole.

Pure logic: `register` takes a peer's identity and its `Register` message and
returns what to send. Servers are ranked in registration order; a worker may ask
for a rank (the launcher asks for its command-line order), the others fill the
free ranks in registration order once all are in.
Servers are welcomed as soon as all of them are in (they need only their shard
range); workers once every server and worker is in (they need every server's
address). A registration whose job token differs from the scheduler's is refused
before anything else.
"""

from dataclasses import dataclass

from omnips.batching import BatchPlan, initial_batches
from omnips.job import JobSpec
from omnips.protocol import Ack, Error, Message, Register, Welcome
from omnips.security import token_matches
from omnips.sharding import shard_ranges


@dataclass(frozen=True)
class Member:
    peer: bytes
    role: str
    rank: int
    info: Register


class Registry:
    def __init__(self, job: JobSpec, num_params: int, num_trained: int, total_steps: int, dead_after_s: float,
                 token: str = ""):
        self.job = job
        self._token = token
        self.num_params = num_params
        self.num_trained = num_trained
        self.total_steps = total_steps
        self.dead_after_s = dead_after_s
        self.ranges = shard_ranges(num_params, job.num_servers)
        self.servers: list[Member] = []
        self.workers: list[Member] = []
        self.by_peer: dict[bytes, Member] = {}
        self.plan: BatchPlan | None = None

    @property
    def complete(self) -> bool:
        return self.plan is not None

    def register(self, peer: bytes, reg: Register) -> list[tuple[bytes, Message]]:
        if not token_matches(reg.token, self._token):  # first: another job's process learns nothing of this one
            return [(peer, Error(code="bad_token", text="the job token differs from the scheduler's (--token / "
                                                        "OMNIPS_TOKEN): this process belongs to another job"))]
        if peer in self.by_peer:
            return [(peer, Error(code="duplicate", text="this connection has registered already"))]
        group, want = (self.servers, self.job.num_servers) if reg.role == "server" else \
            (self.workers, self.job.num_workers)
        if len(group) >= want:
            return [(peer, Error(code="cluster_full", text=f"the job has all {want} {reg.role}s it needs"))]
        if reg.role == "worker" and reg.rank >= 0:
            if reg.rank >= want:
                return [(peer, Error(code="bad_rank", text=f"rank {reg.rank} asked for, the job has ranks 0..{want - 1}"))]
            if any(m.info.rank == reg.rank for m in group):
                return [(peer, Error(code="rank_taken", text=f"another worker asked for rank {reg.rank}"))]
        member = Member(peer, reg.role, len(group), reg)
        group.append(member)
        self.by_peer[peer] = member
        out = [(peer, Ack())]
        if reg.role == "server" and len(self.servers) == self.job.num_servers:
            out += [(m.peer, self._server_welcome(m)) for m in self.servers]
            if len(self.workers) == self.job.num_workers:  # workers were all in first
                out += self._complete()
        elif reg.role == "worker" and len(self.workers) == self.job.num_workers \
                and len(self.servers) == self.job.num_servers:
            out += self._complete()
        return out

    def sharing(self, rank: int) -> int:
        """How many workers draw on worker `rank`'s memory: those on its host's RAM, or its GPU."""
        me = self.workers[rank].info
        return sum(1 for m in self.workers if (m.info.host, m.info.device) == (me.host, me.device))

    def _complete(self):
        asked = {m.info.rank for m in self.workers}
        free = iter(r for r in range(self.job.num_workers) if r not in asked)
        ranked = [Member(m.peer, m.role, m.info.rank if m.info.rank >= 0 else next(free), m.info)
                  for m in self.workers]
        self.workers = sorted(ranked, key=lambda m: m.rank)
        self.by_peer.update({m.peer: m for m in self.workers})
        batches = initial_batches(self.job.batching, self.job.global_batch,
                                  [m.info.capacity for m in self.workers], *self.job.batch_bounds)
        self.plan = BatchPlan(0, tuple(batches))
        return [(m.peer, self._worker_welcome(m)) for m in self.workers]

    def _server_welcome(self, m: Member) -> Welcome:
        lo, hi = self.ranges[m.rank]
        return Welcome(rank=m.rank, job=self.job.to_dict(), cluster={
            "range": [lo, hi], "num_params": self.num_params, "num_trained": self.num_trained,
            "dead_after_s": self.dead_after_s})

    def _worker_welcome(self, m: Member) -> Welcome:
        return Welcome(rank=m.rank, job=self.job.to_dict(), cluster={
            "servers": [s.info.endpoint for s in self.servers], "ranges": [list(r) for r in self.ranges],
            "num_params": self.num_params, "total_steps": self.total_steps, "plan": self.plan.to_wire(),
            "dead_after_s": self.dead_after_s})
