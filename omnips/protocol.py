"""The wire protocol's vocabulary: every op a frozen dataclass with the checks its fields
must pass. omnips/codec.py turns received frames into one of them or raises
`ProtocolError`, so past it nothing handles raw dicts (records inside a message, a
BatchPlan or a welcome's JobSpec, are built and checked there too): one msgpack header
frame (the protocol version `v`, the op, the fields and, when a data frame follows, its
dtype tag and element count), then at most one raw data frame. No pickle: msgpack only.
"""

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from .batching import BatchPlan
from .cluster import ClusterMap, ServerStart, WorkerStart
from .fieldchecks import (MAX_BATCH, MAX_SECONDS, MAX_SPREAD, MIN_SECONDS, at_most, brief, check_place, count,
                          local_endpoints_ok, measured, non_negative, short_line)
from .job import JobSpec

VERSION = 4  # 4: a report carries overhead_s
MAX_HEADER_BYTES = 1 << 20
MAX_PARTS = 256  # a push in parts, and the answer to one, is at most this many messages: a part of a few
# values would make one push (or one message asking for its answer in parts) into millions; and one burst
# of parts must stay well below a socket's high-water mark (1000 messages), where sends fail
MAX_RANKS = 4096  # servers or workers in one job (the scheduler's --num-servers/--num-workers bound)
MAX_PHASE, MAX_REASON = 80, 2000  # characters of a heartbeat's phase and of a failure's reason, which are logged
# data frame dtype tags -> the items' numpy dtype (little-endian); bfloat16 travels as its uint16 bit patterns
# (omnips/wire.py converts); pushes and their replies carry the job's --wire-dtype, every other message float32
DTYPES = {"f4": np.dtype("<f4"), "bf16": np.dtype("<u2"), "f2": np.dtype("<f2")}


class ProtocolError(Exception):
    """A message that must be refused: `code` is stable, `text` says why; `op` is its op
    when the header named a known one."""

    def __init__(self, code: str, text: str, op: str = ""):
        super().__init__(f"{code}: {text}")
        self.code, self.text, self.op = code, text, op


@dataclass(frozen=True)
class Message:
    OP: ClassVar[str] = ""
    HAS_DATA: ClassVar[bool] = False

    def check(self) -> None:
        """Range checks beyond types; raise ValueError with a clear text."""


@dataclass(frozen=True)
class Register(Message):
    OP = "register"
    role: str
    host: str
    endpoint: str = ""  # a server's bound address, "" for workers
    ipc: str = ""  # a server's unix socket for clients on its host (ipc://PATH), "" for none
    capacity: float = 1.0
    device: str = "cpu"
    threads: int = 0
    pid: int = 0
    rank: int = -1  # the rank a worker or server asks for; -1 takes the next free one
    memory_limit: int = 0  # bytes a worker's step may fill at most (--memory-limit); 0: what is free
    token: str = field(default="", repr=False)  # the job token (--token); never printed

    def check(self):
        non_negative(self, "threads", "pid", "memory_limit")
        if self.rank < -1:
            raise ValueError(f"requested rank must be >= 0 (or -1 for any), not {self.rank}")
        if self.role not in ("server", "worker"):
            raise ValueError(f"role must be 'server' or 'worker', not {brief(self.role)}")
        if self.role == "server" and not self.endpoint:
            raise ValueError("a server must register its endpoint")
        if self.ipc and not self.ipc.startswith("ipc://"):
            raise ValueError(f"ipc must be an ipc:// endpoint, not {brief(self.ipc)}")
        if not 0 < self.capacity < float("inf"):
            raise ValueError(f"capacity must be finite and > 0, not {self.capacity}")


@dataclass(frozen=True)
class Welcome(Message):
    """The scheduler's answer to a registration once the process has its rank: the job,
    the cluster and, for the role registered, what it starts from."""

    OP = "welcome"
    rank: int
    job: JobSpec
    cluster: ClusterMap
    server: ServerStart | None = None
    worker: WorkerStart | None = None

    def check(self):
        job, start = self.job, self.server or self.worker
        if (self.server is None) == (self.worker is None):
            raise ValueError("a welcome starts either a server or a worker")
        ranks = job.num_servers if self.server else job.num_workers
        if not 0 <= self.rank < ranks:
            raise ValueError(f"rank {self.rank} in a job of {ranks} {'servers' if self.server else 'workers'}")
        if len(self.cluster.ranges) != job.num_servers:
            raise ValueError(f"cluster.ranges: {len(self.cluster.ranges)} shards in a job of {job.num_servers} servers")
        if self.server and start.num_trained > self.cluster.num_params:
            raise ValueError(f"server.num_trained {start.num_trained} exceeds cluster.num_params "
                             f"{self.cluster.num_params}")
        if self.worker and len(start.plan.batches) != job.num_workers:
            raise ValueError(f"worker.plan: {len(start.plan.batches)} batches in a job of {job.num_workers} workers")


@dataclass(frozen=True)
class Report(Message):
    """A worker's statistics for one finished step (or its last word, done=True)."""

    OP = "report"
    rank: int
    step: int
    batch: int
    compute_s: float
    network_s: float
    wait_s: float
    loss: float
    staleness: int = 0  # ASP: server versions between this step's pull and its update
    mem_batch: int = 0  # the most samples this worker can hold in one pass; 0: no known limit
    mem_free: int = 0  # bytes free on the worker's device (host RAM for the CPU) now; 0: not measured
    sample_bytes: int = 0  # bytes autograd keeps per sample; 0: not measured
    nonfinite: bool = False  # this step's gradient had NaN or inf (dropped, or the end of the job)
    done: bool = False
    overhead_s: float = 0.0  # the step's time outside compute and the servers' hold (network_s among it)

    def check(self):
        non_negative(self, "rank", "step", "staleness", "mem_free", "sample_bytes")
        at_most(self, MAX_BATCH, "batch", "mem_batch")
        at_most(self, MAX_SECONDS, "network_s", "wait_s", "overhead_s")  # differences of clock readings: from 0
        if not (self.compute_s == 0 or measured(self.compute_s)):
            raise ValueError(f"compute_s must be 0 or from {MIN_SECONDS:g} to {MAX_SECONDS:g} s, not {self.compute_s}")


@dataclass(frozen=True)
class Probe(Message):
    """A worker's timed passes before its first step (dynamic batching): each of `batches` took the
    matching `seconds`. The scheduler plans the first step from every probe, answering each with a `Plan`."""

    OP = "probe"
    rank: int
    batches: list
    seconds: list
    mem_free: int = 0  # as in Report: the memory bound applies from the first step
    sample_bytes: int = 0
    spread: float = 0.0  # how far a size's slowest pass ran over its fastest (omnips/batching.probe_times)
    quota: float = 0.0  # the cores of CPU time the worker's cgroups allow it, 0: none (worker/quota.py)

    def check(self):
        non_negative(self, "rank", "mem_free", "sample_bytes", "quota")
        at_most(self, MAX_SPREAD, "spread")
        if (not 2 <= len(self.batches) <= 8 or not all(count(b) and 1 <= b <= MAX_BATCH for b in self.batches)
                or len(set(self.batches)) != len(self.batches)):
            raise ValueError(f"batches must be 2 to 8 distinct sizes from 1 to {MAX_BATCH}, not {brief(self.batches)}")
        if len(self.seconds) != len(self.batches) or not all(type(t) is float and measured(t) for t in self.seconds):
            raise ValueError(f"seconds must be one time from {MIN_SECONDS:g} to {MAX_SECONDS:g} s per batch size, "
                             f"not {brief(self.seconds)}")


@dataclass(frozen=True)
class Heartbeat(Message):
    """Proof of life, both ways. A process's heartbeat with `echo` > 0 asks the scheduler to
    send it back at once: one connection keeps the order, so a process woken from a long
    silence that reads its echo has read every verdict the scheduler sent before it.
    A process's heartbeat also says what it is doing (`phase`: a silence that ends it is
    told with its last phase) and, a worker computing `step`, that step; waiting for the
    servers' answers to its push of it, also for how long and which server ranks have not
    answered (the scheduler names the rank a stalled step waits for)."""
    OP = "heartbeat"
    echo: int = 0
    phase: str = ""  # e.g. "building the model", "computing", "waiting for servers"; "" unsaid
    step: int = -1  # a worker's step in flight; -1: none
    waited_s: float = 0.0  # how long it has waited for the servers' answers to that step's push
    servers: list = field(default_factory=list)  # the server ranks whose answer it still waits for

    def check(self):
        non_negative(self, "echo")
        short_line(self, "phase", MAX_PHASE)
        if self.step < -1:
            raise ValueError(f"step must be >= 0 (or -1 for none), not {self.step}")
        at_most(self, MAX_SECONDS, "waited_s")
        if len(self.servers) > MAX_RANKS or not all(count(s) and s < MAX_RANKS for s in self.servers):
            raise ValueError(f"servers must be server ranks below {MAX_RANKS}, not {brief(self.servers)}")


@dataclass(frozen=True)
class Failed(Message):
    """A process's last word to the scheduler: why it exits (a model or data set that differs
    from the scheduler's, a --model that cannot be imported, a server that does not answer).
    The scheduler logs it and acts at once rather than wait --dead-after for its silence."""
    OP = "failed"
    reason: str

    def check(self):
        if not self.reason:
            raise ValueError("reason must say why")
        short_line(self, "reason", MAX_REASON)


@dataclass(frozen=True)
class Shutdown(Message):
    OP = "shutdown"
    ok: bool
    reason: str = ""
    preempted: bool = False  # stopped to be resumed: the process exits with omnips.job.PREEMPTED_EXIT


@dataclass(frozen=True)
class Leave(Message):
    """A process's SIGTERM: a worker leaves the job after its step in flight; a server,
    which cannot leave without its shard, asks the scheduler to preempt the job."""
    OP = "leave"
    why: str = ""


@dataclass(frozen=True)
class Error(Message):
    OP = "error"
    code: str
    text: str


@dataclass(frozen=True)
class Ack(Message):
    OP = "ack"


@dataclass(frozen=True)
class Init(Message):
    """Worker 0's initial values for one shard; a server serves nothing before it."""

    OP = "init"
    HAS_DATA = True
    rank: int
    data: np.ndarray = field(repr=False)


@dataclass(frozen=True)
class Pull(Message):
    """Ask for a shard now (`at` None) or at the moment its version reaches `at`; with
    `gen`, once the step being collected uses batch plan `gen` or newer (a worker joining
    a BSP job starts at that step). The reply names `request`."""

    OP = "pull"
    request: int
    at: int | None = None
    gen: int = -1

    def check(self):
        non_negative(self, "request")
        if self.at is not None and self.at < 0:
            raise ValueError(f"at must be >= 0, not {self.at}")
        if self.gen < -1:
            raise ValueError(f"gen must be >= 0 (or -1 for none), not {self.gen}")


@dataclass(frozen=True)
class Push(Message):
    """A gradient for one shard at `step`, computed on parameters of version `version`;
    batch 0 and no values: the worker dropped this step's gradient (not finite), and
    any parts of it already sent are void.

    A push may come in parts (buckets sent while backward still runs): each part
    carries values for [offset, offset + len) of a shard of `whole` values, and the
    parts of one push tile the shard exactly; whole 0: the push is in one message."""

    OP = "push"
    HAS_DATA = True
    rank: int
    step: int
    version: int
    batch: int
    gen: int  # the newest batch-plan generation this worker has seen
    data: np.ndarray = field(repr=False)
    offset: int = 0
    whole: int = 0
    reply_part: int = 0  # answer in parts of this many values, first ones first (at most MAX_PARTS parts); 0: whole

    def check(self):
        non_negative(self, "rank", "step", "version", "gen", "batch", "offset", "whole", "reply_part")
        if self.batch == 0 and self.data.size:
            raise ValueError("a dropped gradient (batch 0) carries no values")
        if self.whole and not self.batch:
            raise ValueError("a dropped gradient (batch 0) does not come in parts")
        check_place(self)


@dataclass(frozen=True)
class Params(Message):
    """A shard's values at `version`: the reply to the pull `request`, or to the push of
    `step` (the other -1); or, with `whole` > 0, the values from `offset` on of a shard of
    `whole` values (a reply in parts comes in order, each part with the same header)."""

    OP = "params"
    HAS_DATA = True
    version: int
    held_s: float  # how long the server held the request (barrier or `at` wait)
    plan: BatchPlan | None  # the newest plan, to a worker whose push says it has not seen it
    data: np.ndarray = field(repr=False)
    request: int = -1
    step: int = -1
    offset: int = 0
    whole: int = 0

    def check(self):
        non_negative(self, "version", "offset", "whole")
        if (self.request >= 0) == (self.step >= 0) or min(self.request, self.step) < -1:
            raise ValueError(f"a reply answers one pull request or one push's step (the other -1), not request "
                             f"{self.request} and step {self.step}")
        at_most(self, MAX_SECONDS, "held_s")  # it becomes the worker's reported wait
        check_place(self)


@dataclass(frozen=True)
class Plan(Message):
    """The scheduler's newest batch plan, sent to every server, which hand it on with their
    replies (and to the workers, the first step's after their probes). A batch of 0 marks
    a vacant rank; `departed` lists (rank, last step) for workers gone since the previous
    plan: nobody waits for their later steps."""

    OP = "plan"
    plan: BatchPlan
    departed: tuple[tuple[int, int], ...] = ()

    def check(self):
        if not all(0 <= rank < len(self.plan.batches) and last >= -1 for rank, last in self.departed):
            raise ValueError(f"departed must be (rank, last step or -1) pairs: {brief(self.departed)}")


@dataclass(frozen=True)
class Checkpoint(Message):
    """Ask a server to write its shard and optimizer state as checkpoint `step`, when
    its version reaches `at` (None: at once); it answers with `saved`."""

    OP = "checkpoint"
    request: int
    step: int
    at: int | None = None

    def check(self):
        non_negative(self, "request", "step")
        if self.at is not None and self.at < 0:
            raise ValueError(f"at must be >= 0, not {self.at}")


@dataclass(frozen=True)
class Saved(Message):
    """A server's shard file for checkpoint `step` is written and synced (size and
    SHA-256 as omnips.checkpoint records them), or `error` says why it is not."""

    OP = "saved"
    request: int
    step: int
    version: int = 0
    size: int = 0
    sha256: str = ""
    error: str = ""
    write_s: float = 0.0  # how long writing the file took (steps then are not measured)

    def check(self):
        non_negative(self, "request", "step", "version", "size")
        at_most(self, MAX_SECONDS, "write_s")


@dataclass(frozen=True)
class Restore(Message):
    """Scheduler to a server, after another server died: forget every request and go
    back to the checkpoint in `path`; it answers `ack` once restored."""

    OP = "restore"
    path: str


@dataclass(frozen=True)
class Rewind(Message):
    """Scheduler to the workers, once every server is back at a checkpoint: worker r
    continues at step `steps[r]` and sample position `positions[r]` with `plan`, on the
    servers at `servers` (a restarted one has a new address); `ipc` holds each one's
    [hostname, ipc endpoint or ""], as in the welcome (omnips.routes)."""

    OP = "rewind"
    steps: list
    positions: list
    plan: BatchPlan
    servers: tuple[str, ...]
    ipc: tuple[tuple[str, str], ...] = ()

    def check(self):
        if not self.steps or len(self.positions) != len(self.steps) \
                or not all(count(x) for x in [*self.steps, *self.positions]):
            raise ValueError("steps and positions must be one count per worker")
        self.plan.sized(len(self.steps))
        if not self.servers:
            raise ValueError("servers must name every server's endpoint")
        if not local_endpoints_ok(self.ipc, self.servers):
            raise ValueError("ipc must hold one [host, ipc:// endpoint or \"\"] pair per server, or none")


OPS = {cls.OP: cls for cls in (Register, Welcome, Report, Probe, Heartbeat, Failed, Shutdown, Leave, Error,
                               Ack, Init, Pull, Push, Params, Plan, Checkpoint, Saved, Restore, Rewind)}
