"""A server's or worker's connection to the scheduler: registration, liveness, messages.

Registration is two-phase so that a wrong address fails fast: the scheduler
acknowledges a `register` at once (a missing ack within `ack_timeout_s` means
nobody is listening there), then sends `welcome` when the whole cluster is in.
While waiting, and all through the job, the scheduler's heartbeats prove it
alive; silence for `dead_after_s` ends the process with a clear error. Ours go the
other way every `heartbeat_s`: a worker silent for long leaves the job.
"""

import logging
import time

import zmq

from . import protocol, transport
from .protocol import Ack, Error, Heartbeat, ProtocolError, Register, Shutdown, Welcome

log = logging.getLogger(__name__)


class LinkError(RuntimeError):
    """The scheduler cannot be reached, refused us, or went silent."""


class SchedulerLink:
    def __init__(self, ctx: zmq.Context, endpoint: str, dead_after_s: float = 30.0, clock=time.monotonic):
        self.endpoint = endpoint
        self.dead_after_s = dead_after_s
        self.heartbeat_s = 1.0
        self.clock = clock
        self._beat_at = clock()
        self.sock = transport.socket(ctx, zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)  # reports are small; never block a training step
        transport.connect(self.sock, endpoint)
        self.last_heard = clock()

    def register(self, reg: Register, ack_timeout_s: float, welcome_timeout_s: float) -> Welcome:
        transport.send(self.sock, reg)
        if not isinstance(self._next(ack_timeout_s, "acknowledge the registration"), Ack):
            raise LinkError(f"scheduler at {self.endpoint} answered the registration out of turn")
        msg = self._next(welcome_timeout_s, "complete the cluster (are all servers and workers started?)")
        if not isinstance(msg, Welcome):
            raise LinkError(f"expected welcome from the scheduler, got {msg.OP}")
        return msg

    @staticmethod
    def cluster_fields(welcome: Welcome, **types) -> dict:
        """welcome.cluster checked to hold each named field with its type."""
        for key, tp in types.items():
            if not protocol.type_ok(welcome.cluster.get(key), tp):
                raise LinkError(f"malformed welcome from the scheduler: {key!r} is not {tp.__name__}")
        return welcome.cluster

    def _next(self, timeout_s: float, what: str) -> protocol.Message:
        """The next message that is not a heartbeat, or LinkError after `timeout_s`."""
        deadline = self.clock() + timeout_s
        while True:
            left = deadline - self.clock()
            if left <= 0:
                raise LinkError(f"scheduler at {self.endpoint} did not {what} within {timeout_s:g} s")
            if not transport.wait_readable(self.sock, min(left, 1.0)):
                self.check_alive()  # the scheduler heartbeats registered processes while they wait
                continue
            msg = self.receive()
            if msg is not None:
                return msg

    def receive(self) -> protocol.Message | None:
        """Decode one waiting message; None for heartbeats and refused frames.
        Raises LinkError for an error or a failed shutdown sent by the scheduler."""
        frames = transport.recv_frames(self.sock)
        try:
            msg = protocol.decode(frames)
        except ProtocolError as exc:
            log.warning("dropped a bad message from the scheduler: %s", exc)
            return None
        self.last_heard = self.clock()
        if isinstance(msg, Heartbeat):
            return None
        if isinstance(msg, Error):
            raise LinkError(f"scheduler refused us: {msg.code}: {msg.text}")
        if isinstance(msg, Shutdown) and not msg.ok:
            raise LinkError(f"scheduler ended the job: {msg.reason}")
        return msg

    def check_alive(self) -> None:
        """Judge the scheduler's silence, and break ours when a heartbeat is due."""
        now = self.clock()
        silent = now - self.last_heard
        if silent > self.dead_after_s:
            raise LinkError(f"no word from the scheduler at {self.endpoint} for {silent:.0f} s: giving up")
        if now - self._beat_at >= self.heartbeat_s:
            self._beat_at = now
            self.send(Heartbeat())

    def send(self, msg: protocol.Message) -> None:
        try:
            transport.send(self.sock, msg)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to the scheduler: %s", msg.OP, exc.strerror)
