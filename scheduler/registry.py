"""Rendezvous: who has registered, their ranks, and the welcomes once the cluster is whole.

Pure logic: `register` takes a peer's identity and its `Register` message and
returns what to send. A server or a worker may ask for a rank (the launcher asks
for its command-line order, which names its log); the others fill the free ranks
in registration order once all servers (all workers) are in.
Servers are welcomed as soon as all of them are in (they need only their shard
range); workers once every server and --min-workers workers are in (they need
every server's address): the registry then says the cluster is complete, and the
scheduler welcomes them with the first plan (the plan is scheduler/planning.py's).
Later a worker takes a vacant rank: one never filled, or one whose worker was lost. A resumed job's welcomes name the checkpoint servers
restore their shard from and the step and sample position workers continue at.
A registration whose job token differs from the scheduler's is refused before
anything else.
"""

from dataclasses import dataclass

from omnips.batching import BatchPlan, initial_batches, spread
from omnips.checkpoint import Manifest
from omnips.cluster import ClusterMap, ServerStart, WorkerStart
from omnips.job import JobSpec
from omnips.protocol import Ack, Error, Message, Register, Welcome
from omnips.access import token_matches
from omnips.sharding import shard_ranges


@dataclass(frozen=True)
class Member:
    peer: bytes
    role: str
    rank: int
    info: Register

    def __str__(self) -> str:
        """How logs name it (a ZeroMQ identity says nothing to a reader)."""
        return f"{self.role} {self.rank} on {self.info.host} (pid {self.info.pid})"


class Registry:
    def __init__(self, job: JobSpec, num_params: int, num_trained: int, total_steps: int, dead_after_s: float,
                 heartbeat_s: float = 1.0, checkpoint_dir: str = "", resume: Manifest | None = None,
                 token: str = ""):
        self.job = job
        self.checkpoint_dir, self.resume = checkpoint_dir, resume
        self._token = token
        self.num_params = num_params
        self.num_trained = num_trained
        self.total_steps = total_steps
        self.dead_after_s = dead_after_s
        self.heartbeat_s = heartbeat_s
        self.ranges = shard_ranges(num_params, job.num_servers)
        self.servers: list[Member] = []
        self.vacant_servers: set[int] = set()  # ranks of servers lost, until a new one takes them
        self.reseated: list[Member] = []  # servers that took such a rank: the scheduler welcomes them
        self.waiting: list[Member] = []  # workers registered before the job started
        self.workers: dict[int, Member] = {}  # rank -> the worker in it, once the job started
        self.joined: list[Member] = []  # workers seated after the start: the scheduler welcomes them
        self.by_peer: dict[bytes, Member] = {}
        self._gone: dict[bytes, Member] = {}  # members lost: a word still sent to one is named
        self.complete = False  # every server and --min-workers workers are in: the job has started
        self.fingerprints: dict = {}  # digests of the scheduler's model and data set: workers compare theirs

    @property
    def vacant(self) -> list[int]:
        return [r for r in range(self.job.num_workers) if r not in self.workers]

    def refusal(self, peer: bytes, reg: Register) -> Error | None:
        """Why `reg` is refused whatever the cluster's state, if it is."""
        if not token_matches(reg.token, self._token):  # first: another job's process learns nothing of this one
            return Error(code="bad_token", text="the job token differs from the scheduler's (--token / "
                                                "OMNIPS_TOKEN): this process belongs to another job")
        if peer in self.by_peer:
            return Error(code="duplicate", text="this connection has registered already")
        return None

    def register(self, peer: bytes, reg: Register) -> list[tuple[bytes, Message]]:
        refused = self.refusal(peer, reg)
        if refused is not None:
            return [(peer, refused)]
        if reg.role == "worker" and self.complete:
            return self._seat(peer, reg)
        if reg.role == "server" and self.vacant_servers:
            member = Member(peer, "server", min(self.vacant_servers), reg)
            self.vacant_servers.discard(member.rank)
            self.servers[member.rank] = member
            self.by_peer[peer] = member
            self.reseated.append(member)
            return [(peer, Ack())]
        group, want = (self.servers, self.job.num_servers) if reg.role == "server" else \
            (self.waiting, self.job.num_workers)
        if len(group) >= want:
            return [(peer, Error(code="cluster_full", text=f"the job has all {want} {reg.role}s it needs"))]
        refusal = self._rank_refusal(reg, {m.info.rank for m in group})
        if refusal:
            return [(peer, refusal)]
        member = Member(peer, reg.role, len(group), reg)  # a server's rank is final once all are in
        group.append(member)
        self.by_peer[peer] = member
        out = [(peer, Ack())]
        servers_in = len(self.servers) == self.job.num_servers
        if reg.role == "server" and servers_in:
            self.servers = sorted(_ranked(self.servers, self.job.num_servers), key=lambda m: m.rank)
            self.by_peer.update({m.peer: m for m in self.servers})
            out += [(m.peer, self.server_welcome(m)) for m in self.servers]
        if servers_in and len(self.waiting) >= self.job.start_workers:
            self._complete()
        return out

    def missing(self) -> str:
        """Who the start still waits for, in words (the cluster is not complete)."""
        job = self.job
        gaps = [f"{job.num_servers - len(self.servers)} of {job.num_servers} servers"] \
            if len(self.servers) < job.num_servers else []
        if len(self.waiting) < job.start_workers:
            asked = {m.info.rank for m in self.waiting}
            gaps.append(f"{job.start_workers - len(self.waiting)} of {job.start_workers} workers")
            if -1 not in asked:  # every worker in asked for its rank (the launcher's do): name the others
                gaps[-1] += f" (ranks {', '.join(str(r) for r in range(job.num_workers) if r not in asked)} not in)"
        return " and ".join(gaps)

    def _rank_refusal(self, reg: Register, taken) -> Error | None:
        if reg.rank < 0:
            return None
        ranks = self.job.num_workers if reg.role == "worker" else self.job.num_servers
        if reg.rank >= ranks:
            return Error(code="bad_rank", text=f"{reg.role} rank {reg.rank} asked for, the job has ranks 0..{ranks - 1}")
        if reg.rank in taken:
            return Error(code="rank_taken", text=f"another {reg.role} has rank {reg.rank}")
        return None

    def _complete(self) -> None:
        """Seat the waiting workers; the scheduler welcomes them with the first plan."""
        self.workers = {m.rank: m for m in _ranked(self.waiting, self.job.num_workers)}
        self.workers = dict(sorted(self.workers.items()))
        self.waiting = []
        self.by_peer.update({m.peer: m for m in self.workers.values()})
        self.complete = True

    def _seat(self, peer: bytes, reg: Register) -> list[tuple[bytes, Message]]:
        """A worker registering after the start takes a vacant rank (the one it asks for, or
        the lowest); the scheduler plans its share and welcomes it."""
        vacant = self.vacant
        if not vacant:
            return [(peer, Error(code="cluster_full", text=f"all {self.job.num_workers} worker ranks are taken"))]
        refusal = self._rank_refusal(reg, set(self.workers))
        if refusal:
            return [(peer, refusal)]
        member = Member(peer, "worker", reg.rank if reg.rank >= 0 else vacant[0], reg)
        self.workers = dict(sorted({**self.workers, member.rank: member}.items()))
        self.by_peer[peer] = member
        self.joined.append(member)
        return [(peer, Ack())]

    def vacate_server(self, rank: int) -> None:
        """Server `rank` is gone: the next server to register takes its shard."""
        self._gone[self.servers[rank].peer] = self.by_peer.pop(self.servers[rank].peer, self.servers[rank])
        self.vacant_servers.add(rank)

    def depart(self, rank: int) -> Member:
        """The worker in `rank` is gone: its rank becomes vacant."""
        member = self.workers.pop(rank)
        self._gone[member.peer] = self.by_peer.pop(member.peer, member)
        return member

    def describe(self, peer: bytes) -> str:
        """Who `peer` is, in words: role, rank, host and pid."""
        member = self.by_peer.get(peer) or self._gone.get(peer)
        if member is None:
            return f"a peer that has not registered ({peer!r})"
        if member in self.waiting:  # its rank is given when the job starts
            return f"{member.role} on {member.info.host} (pid {member.info.pid}), not ranked yet"
        return str(member)

    def static_batches(self, ranks: list[int]) -> tuple[int, ...]:
        """The split among the workers in `ranks` by --batching uniform or by declared capacity."""
        batches = initial_batches(self.job.batching, self.job.global_batch,
                                  [self.workers[r].info.capacity for r in ranks], *self.job.batch_bounds)
        return spread(batches, ranks, self.job.num_workers)

    def sharing(self, rank: int) -> int:
        """How many workers draw on worker `rank`'s memory: those on its host's RAM, or its GPU."""
        me = self.workers[rank].info
        return sum(1 for m in self.workers.values() if (m.info.host, m.info.device) == (me.host, me.device))

    def endpoints(self) -> tuple[str, ...]:
        return tuple(s.info.endpoint for s in self.servers)

    def local_endpoints(self) -> tuple[tuple[str, str], ...]:
        """(hostname, ipc endpoint or "") per server: clients on a server's host connect there."""
        return tuple((s.info.host, s.info.ipc) for s in self.servers)

    def cluster_map(self) -> ClusterMap:
        return ClusterMap(num_params=self.num_params, ranges=tuple(self.ranges), servers=self.endpoints(),
                          ipc=self.local_endpoints(), dead_after_s=self.dead_after_s, heartbeat_s=self.heartbeat_s)

    def server_welcome(self, m: Member, restore: str = "") -> Welcome:
        """`restore`: the checkpoint a server taking a lost one's shard starts from."""
        start = ServerStart(num_trained=self.num_trained, checkpoint_dir=self.checkpoint_dir,
                            restore=restore or (str(self.resume.path) if self.resume else ""))
        return Welcome(rank=m.rank, job=self.job, cluster=self.cluster_map(), server=start)

    def worker_welcome(self, m: Member, plan: BatchPlan, join_gen: int = -1, start_step: int = 0) -> Welcome:
        """A worker's welcome with the `plan` in force. `join_gen` >= 0 for a worker joining a
        running job: it starts at the first step of that plan (BSP) or at `start_step` (ASP,
        SSP), and does not initialise the shards."""
        at_checkpoint = self.resume is not None and join_gen < 0  # a resumed job's starting worker
        start = WorkerStart(
            plan=plan, total_steps=self.total_steps, join_gen=join_gen, resumed=self.resume is not None,
            step=self.resume.worker_steps[m.rank] if at_checkpoint else start_step,
            position=self.resume.positions[m.rank] if at_checkpoint else 0,
            host_workers=max(1, sum(w.info.host == m.info.host for w in self.workers.values())),
            fingerprints=self.fingerprints)
        return Welcome(rank=m.rank, job=self.job, cluster=self.cluster_map(), worker=start)


def _ranked(members: list[Member], ranks: int) -> list[Member]:
    """`members` with final ranks: the one each asked for, the free ones in registration order."""
    asked = {m.info.rank for m in members}
    free = iter(r for r in range(ranks) if r not in asked)
    return [Member(m.peer, m.role, m.info.rank if m.info.rank >= 0 else next(free), m.info) for m in members]
