"""A server's or worker's connection to the scheduler: registration, liveness, messages.

Registration is two-phase so that a wrong address fails fast: the scheduler
acknowledges a `register` at once (a missing ack within `ack_timeout_s` means
nobody is listening there; a listener that refuses the connection itself, for want
of the right keys, is reported at once), then sends `welcome` when the whole cluster is in.
While waiting, and all through the job, the scheduler's heartbeats prove it
alive; silence for `dead_after_s` ends the process with a clear error. Ours go the
other way every `heartbeat_s`: a worker silent for long leaves the job. From the welcome
on they leave from a thread that owns the socket (omnips.linkthread), whatever the
process does meanwhile; before it, from the waits for the welcome.
"""

import logging
import threading
import time
from contextlib import contextmanager

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import codec, protocol, security, transport
from .linkthread import LinkThread
from .protocol import Ack, Error, Heartbeat, ProtocolError, Register, Shutdown, Welcome

log = logging.getLogger(__name__)


PHASE_ECHO_S = 1.0  # the longest a phase waits for the scheduler's echo of its first heartbeat


class LinkError(RuntimeError):
    """The scheduler cannot be reached, refused us, or went silent."""


class Preempted(LinkError):
    """The scheduler stopped the job to be resumed (omnips.job.PREEMPTED_EXIT)."""


class SchedulerLink:
    def __init__(self, ctx: zmq.Context, endpoint: str, dead_after_s: float = 30.0, clock=time.monotonic,
                 keys: security.Keys | None = None):
        self.endpoint = endpoint
        self.dead_after_s = dead_after_s
        self.heartbeat_s = 1.0
        self.clock = clock
        self._beat_at = clock()  # when our last heartbeat left
        self._silence = 0.0  # a silence of ours the scheduler may have taken for our loss, not yet answered
        self._beats = threading.Lock()  # over those two: the thread beats, the process asks echoes
        self._thread: LinkThread | None = None
        self.keys = keys
        self.sock = transport.socket(ctx, zmq.DEALER)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)  # reports are small; never block a training step
        # watched from before the connection until registration: a refused handshake is not retried
        self._handshakes = self.sock.get_monitor_socket(security.HANDSHAKE_FAILED)
        transport.connect(self.sock, endpoint, keys)
        self.last_heard = clock()
        self._echo_asked = 0  # the last heartbeat we asked the scheduler to echo
        self._echo_heard = 0  # the last echo read
        # what our heartbeats say we are doing: Heartbeat's phase (and a worker's step, how long
        # it has waited and for which servers); a silence that ends the process is told with
        # its phase. Replaced whole, never changed in place: the thread reads it.
        self.state: dict = {}

    def register(self, reg: Register, ack_timeout_s: float, welcome_timeout_s: float) -> Welcome:
        try:
            transport.send(self.sock, reg)
            ack = self._next(ack_timeout_s, "acknowledge the registration", self._handshakes)
        finally:
            self.sock.disable_monitor()
            self._handshakes.close()
        if not isinstance(ack, Ack):
            raise LinkError(f"scheduler at {self.endpoint} answered the registration out of turn")
        msg = self._next(welcome_timeout_s, "complete the cluster (are all servers and workers started?)")
        if not isinstance(msg, Welcome):
            raise LinkError(f"expected welcome from the scheduler, got {msg.OP}")
        if getattr(msg, reg.role) is None:
            raise LinkError(f"malformed welcome from the scheduler: it does not start a {reg.role}")
        self.start_thread()
        return msg

    def start_thread(self) -> None:
        """Hand the socket to a thread that sends our heartbeats on time from now on, and
        read and send through its pipe (`sock` is that pipe's end after this)."""
        self._thread = LinkThread(self.sock.context, self.sock, self._heartbeat, lambda: self.heartbeat_s)
        self.sock = self._thread.pipe

    def close(self) -> None:
        """Send what is left and end the thread (nothing when there is none); call before
        the context ends, on every way out."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

    def _next(self, timeout_s: float, what: str, handshakes: zmq.Socket | None = None) -> protocol.Message:
        """The next message that is not a heartbeat, or LinkError after `timeout_s` or
        when `handshakes` (a monitor of the socket) reports a refused connection."""
        deadline = self.clock() + timeout_s
        poller = zmq.Poller()
        for sock in (self.sock, handshakes):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while True:
            left = deadline - self.clock()
            if left <= 0:
                raise LinkError(f"scheduler at {self.endpoint} did not {what} within {timeout_s:g} s")
            events = dict(poller.poll(int(min(left, 1.0) * 1000)))
            if handshakes in events:
                event = recv_monitor_message(handshakes)
                raise LinkError(f"cannot join the scheduler at {self.endpoint}: "
                                f"{security.handshake_failure(event['event'], event['value'], self.keys)}")
            if self.sock not in events:
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
            msg = codec.decode(frames)
        except ProtocolError as exc:
            if exc.op == "welcome":  # the process cannot start without one: say why at once
                raise LinkError(f"malformed welcome from the scheduler: {exc.text}") from None
            log.warning("dropped a bad message from the scheduler: %s", exc)
            return None
        self.last_heard = self.clock()
        if isinstance(msg, Heartbeat):
            self._echo_heard = max(self._echo_heard, msg.echo)
            return None
        if isinstance(msg, Error):
            raise LinkError(f"scheduler refused us: {msg.code}: {msg.text}")
        if isinstance(msg, Shutdown) and msg.preempted:
            raise Preempted(f"scheduler stopped the job to be resumed: {msg.reason}")
        if isinstance(msg, Shutdown) and not msg.ok:
            raise LinkError(f"scheduler ended the job: {msg.reason}")
        return msg

    def check_alive(self) -> None:
        """Judge the scheduler's silence, and break ours when a heartbeat is due. Before it
        gives up, it waits a heartbeat interval for a message: a process that was itself
        frozen (SIGSTOP, a stalled host) wakes to a clock that has jumped while what the
        scheduler sent meanwhile is still on its way into the socket. Judged at once, it
        would take its own silence for the scheduler's, and miss the reason it was sent
        (a worker taken for dead: "removed from the job"). The caller reads what came."""
        now = self.clock()
        if now - self.last_heard > self.dead_after_s and not self.sock.poll(int(1000 * self.heartbeat_s)):
            silent = self.clock() - self.last_heard
            phase = self.state.get("phase")
            raise LinkError(f"no word from the scheduler at {self.endpoint} for {silent:.0f} s"
                            + (f" (while {phase})" if phase else "") + ": giving up")
        if self._thread is None and now - self._beat_at >= self.heartbeat_s:
            self.send(self._heartbeat())

    def _heartbeat(self) -> Heartbeat:
        """Our heartbeat, due now (sent by the thread once it runs). It asks again for an echo
        still awaited: one lost (a full queue) must not hold us. A silence since the last
        one long enough for the scheduler to have taken us for lost (the whole process
        frozen, or starved of CPU) is kept until `ask_echo` answers it: this heartbeat ends
        it before the process may look."""
        now = self.clock()
        with self._beats:
            if now - self._beat_at > self.dead_after_s - self.heartbeat_s:
                self._silence = max(self._silence, now - self._beat_at)
            self._beat_at = now
        return Heartbeat(echo=0 if self.echoed() else self._echo_asked, **self.state)

    def quiet_s(self) -> float:
        """How long since the scheduler was last heard (from what has been read)."""
        return self.clock() - self.last_heard

    @contextmanager
    def in_phase(self, phase: str):
        """Our heartbeats say `phase` while the block runs (loading the data set, building
        the model, restoring a shard): a silence that ends the process is told with it. One
        says it at once, and the block waits for the scheduler's echo of it (a heartbeat
        interval at most, PHASE_ECHO_S): a process that stops at the start of the block
        (SIGSTOP, a frozen host) is lost with it, not with the phase before, its heartbeat
        still inside the process (seen under load: the thread had not sent it yet)."""
        before = self.state
        self.state = {"phase": phase}
        if self._thread is None:
            self.send(self._heartbeat())
        else:
            self._echo_asked += 1
            self._thread.expect_echo(self._echo_asked)
            self.send(self._heartbeat())  # (asks for the echo: not echoed() now)
            if not self._thread.wait_echo(self._echo_asked, min(self.heartbeat_s, PHASE_ECHO_S)):
                log.debug("the scheduler did not echo our phase %r at once", phase)
        try:
            yield
        finally:
            self.state = before

    def ask_echo(self) -> None:
        """Send a heartbeat the scheduler echoes at once; `echoed` tells when it is back.
        It answers a silence of ours (silent_s)."""
        self._echo_asked += 1
        with self._beats:
            self._beat_at, self._silence = self.clock(), 0.0
        self.send(Heartbeat(echo=self._echo_asked))

    def echoed(self) -> bool:
        """Whether the echo of the last `ask_echo` (or phase) has been read (True when none was asked):
        then so has everything the scheduler sent before it heard that heartbeat."""
        return self._echo_heard >= self._echo_asked

    def silent_s(self) -> float:
        """Our longest silence since the last `ask_echo`, the one going on included: past
        --dead-after, the scheduler may have taken us for lost (a process frozen, or
        starved of CPU, sends nothing, from no thread)."""
        with self._beats:
            return max(self.clock() - self._beat_at, self._silence)

    def send(self, msg: protocol.Message) -> None:
        try:
            transport.send(self.sock, msg)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to the scheduler: %s", msg.OP, exc.strerror)
