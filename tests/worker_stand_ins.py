"""A real worker (worker.service.run, in a thread of the test) against a stand-in scheduler
and a stand-in server in the test's own process: each a ROUTER the test drives, so that
what the worker meets, and in which order, is the test's to choose (a server's refusal
before the scheduler's rewind, say) rather than a race between processes."""

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from omnips import codec, data, models, transport
from omnips.batching import BatchPlan
from omnips.cluster import ClusterMap, WorkerStart
from omnips.flat import FlatModel
from omnips.job import JobSpec
from omnips.protocol import Ack, Error, Heartbeat, Init, Params, Pull, Push, Register, Welcome
from omnips.worker.options import WorkerOptions

WAIT_S = 60.0  # the longest any wait here takes (a loaded host builds the model slowly)
JOB = JobSpec(mode="bsp", num_servers=1, num_workers=1, model="mlp", dataset="synthetic",
              dataset_args={"n": 256, "features": 8}, global_batch=8, max_steps=6)


def num_params(job: JobSpec) -> int:
    train, _ = data.load(job.dataset, job.dataset_args)
    return FlatModel(models.build(job.model, job.model_args, train, job.seed)).size


class StandInServer:
    """One shard's stand-in: takes the init, answers pulls at its version and pushes one
    version on; `refuse` maps a step to the version it says it is at, refusing that
    step's push once with `code` (bad_version: as a shard restored from a checkpoint does),
    going back to that version."""

    def __init__(self, ctx: zmq.Context, n: int, refuse: dict[int, int] | None = None, code: str = "bad_version"):
        self.sock = transport.socket(ctx, zmq.ROUTER)
        self.endpoint = transport.bind(self.sock, "127.0.0.1", 0)
        self.values = np.zeros(n, dtype=np.float32)
        self.version = 0
        self.refuse, self.code = dict(refuse or {}), code
        self.pushes: list[tuple[int, int]] = []  # (step, version it was computed on), in order

    def serve(self) -> None:
        while self.sock.poll(0):
            frames = transport.recv_frames(self.sock)
            peer, msg = frames[0].bytes, codec.decode(frames[1:])
            if isinstance(msg, Init):
                self.values[:] = msg.data
                reply = Ack()
            elif isinstance(msg, Pull):
                reply = self._params(request=msg.request)
            elif isinstance(msg, Push) and msg.step in self.refuse:
                self.version = self.refuse.pop(msg.step)
                reply = Error(code=self.code, text=f"push computed on version {msg.version}, shard is at "
                                                       f"{self.version}")
            else:
                self.pushes.append((msg.step, msg.version))
                self.version += 1
                reply = self._params(step=msg.step)
            transport.send(self.sock, reply, to=peer)

    def _params(self, request: int = -1, step: int = -1) -> Params:
        return Params(request=request, step=step, version=self.version, held_s=0.0, plan=None, data=self.values)


@dataclass
class StandInScheduler:
    """Welcomes one worker to `job` on `servers`, echoes its heartbeats and keeps what it says."""

    ctx: zmq.Context
    job: JobSpec
    servers: list[str]
    n: int
    heard: list = field(default_factory=list)  # every message but heartbeats, in order
    phases: list = field(default_factory=list)  # the phases its heartbeats named, each once in order

    def __post_init__(self):
        self.sock = transport.socket(self.ctx, zmq.ROUTER)
        self.endpoint = transport.bind(self.sock, "127.0.0.1", 0)
        self.peer = None

    def serve(self) -> None:
        while self.sock.poll(0):
            frames = transport.recv_frames(self.sock)
            self.peer, msg = frames[0].bytes, codec.decode(frames[1:])
            if isinstance(msg, Register):
                self.send(Ack())
                cluster = ClusterMap(self.n, ((0, self.n),), tuple(self.servers), 30.0, 0.2)
                start = WorkerStart(BatchPlan(0, (self.job.global_batch,)), self.job.max_steps)
                self.send(Welcome(rank=0, job=self.job, cluster=cluster, worker=start))
            elif isinstance(msg, Heartbeat):
                if msg.phase and (not self.phases or self.phases[-1] != msg.phase):
                    self.phases.append(msg.phase)
                self.send(Heartbeat(echo=msg.echo), dropped_if_gone=True)
            else:
                self.heard.append(msg)

    def send(self, msg, dropped_if_gone: bool = False) -> None:
        """To the worker; an echo of a heartbeat read just before the worker ended goes nowhere,
        as a real scheduler's does (its socket refuses a peer that is gone)."""
        try:
            transport.send(self.sock, msg, to=self.peer)
        except zmq.ZMQError as exc:
            if not (dropped_if_gone and exc.errno == zmq.EHOSTUNREACH):
                raise


class WorkerThread:
    """worker.service.run in a thread: its exit code, or the exception it ended with."""

    def __init__(self, scheduler: str, **opts):
        from omnips.worker import service  # torch: only for the tests that run a worker
        self.outcome = None
        options = WorkerOptions(scheduler, device="cpu", threads=1, bucket_bytes=0, **opts)

        def run():
            try:
                self.outcome = service.run(options)
            except Exception as exc:  # the test reads it
                self.outcome = exc

        self.thread = threading.Thread(target=run, name="worker", daemon=True)
        self.thread.start()


def drive(parts, until, what: str) -> None:
    """Serve each of `parts` until `until()`: AssertionError naming `what` after WAIT_S."""
    poller = zmq.Poller()
    for part in parts:
        poller.register(part.sock, zmq.POLLIN)
    deadline = time.monotonic() + WAIT_S
    while not until():
        assert time.monotonic() < deadline, f"no {what} within {WAIT_S:g} s"
        poller.poll(100)
        for part in parts:
            part.serve()
