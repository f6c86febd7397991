"""The thread that owns a process's socket to the scheduler once the job has started, so
that heartbeats leave on time whatever the process does meanwhile: a training step's
compute longer than --dead-after, a large checkpoint read, a long update.

ZeroMQ sockets are not thread-safe, so the socket is not shared: the thread is its only
user, and the process's own thread talks to it through an inproc pipe (a PAIR each end).
Everything the process sends goes down the pipe and out on the socket in order;
everything the scheduler sends comes up the pipe unread, where the process polls and reads
as it did the socket. One connection to the scheduler keeps every message's order (a
heartbeat's echo still follows whatever the scheduler sent before it), and the scheduler
sees one peer as before. A lock around every use of one shared socket would do too, but
the process's long polls (the server's loop, a waiting worker) would hold the heartbeats
up for as long; a second socket for heartbeats would be a second peer the scheduler must
pair with the first.
"""

import logging
import threading
import time
from collections.abc import Callable

import zmq

from . import codec, protocol, transport
from .protocol import Heartbeat, ProtocolError

log = logging.getLogger(__name__)

STOP = b""  # down the pipe after the last message: no encoded message is one empty frame
JOIN_S = 5.0  # how long `stop` waits for the thread to send what is left and end
WAKE_S = 0.1  # the longest the thread sleeps: a shorter interval set meanwhile is kept within it


class LinkThread:
    """Relays between `sock` (handed over: the caller no longer touches it) and `pipe`,
    the end the caller keeps, and sends `heartbeat()` every `interval_s()` seconds, the
    first at once (both are read each time: the welcome changes the interval)."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, heartbeat: Callable[[], protocol.Message],
                 interval_s: Callable[[], float]):
        address = f"inproc://omnips-link-{id(self):x}"
        self.pipe = ctx.socket(zmq.PAIR)
        self._far = ctx.socket(zmq.PAIR)
        for end in (self.pipe, self._far):
            end.setsockopt(zmq.LINGER, 0)
            end.setsockopt(zmq.SNDHWM, 0)  # inproc, in memory: the caller's sends never block or fail
            end.setsockopt(zmq.RCVHWM, 0)
        self.pipe.bind(address)
        self._far.connect(address)
        self._sock, self._heartbeat, self._interval_s = sock, heartbeat, interval_s
        # the echoes the scheduler sent, as they pass up the pipe: a wait for one (wait_echo) needs
        # no read of the pipe, where other messages stay in order for the process
        self._echoes = threading.Condition()
        self._echo_wanted = self._echo_seen = 0
        # a daemon: a process that ends without `stop` (an uncaught error) is not held up
        self._thread = threading.Thread(target=self._run, name="scheduler-link", daemon=True)
        self._thread.start()  # (a full memory barrier: the sockets now belong to the thread)

    def stop(self) -> None:
        """Send what the caller has sent, then end the thread and close both ends of the pipe."""
        if self._thread.is_alive():
            self.pipe.send(STOP, flags=zmq.NOBLOCK)
            self._thread.join(JOIN_S)
            if self._thread.is_alive():  # left to die with the process; its sockets with the context
                log.warning("the thread sending our heartbeats did not end within %g s", JOIN_S)
                return
        self.pipe.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._far, zmq.POLLIN)
        last = -float("inf")  # when our last heartbeat left
        try:
            while True:
                if time.monotonic() >= last + self._interval_s():  # read each turn: the welcome shortens it
                    self._send(self._heartbeat())
                    last = time.monotonic()
                wait_s = min(WAKE_S, last + self._interval_s() - time.monotonic())
                events = dict(poller.poll(max(0, int(1000 * wait_s)) + 1))
                if self._sock in events:
                    while self._sock.poll(0):
                        frames = transport.recv_frames(self._sock)
                        self._note_echo(frames)
                        self._far.send_multipart(frames, copy=False)
                if self._far in events:
                    while self._far.poll(0):
                        frames = transport.recv_frames(self._far)
                        if len(frames) == 1 and frames[0].bytes == STOP:
                            return
                        self._relay(frames)
        except zmq.ZMQError as exc:  # the context ended under us: the process is exiting
            log.debug("the link's thread ends: %s", exc)
        except Exception:  # never silently: without it our heartbeats stop
            log.exception("the thread sending our heartbeats failed")
        finally:
            self._sock.close()  # its linger lets the last messages leave
            self._far.close()

    def expect_echo(self, echo: int) -> None:
        """Watch for the scheduler's echo `echo` from now on (before the heartbeat asking it leaves)."""
        with self._echoes:
            self._echo_wanted = max(self._echo_wanted, echo)

    def wait_echo(self, echo: int, timeout_s: float) -> bool:
        """Whether the scheduler's echo `echo` (expected) came within `timeout_s`."""
        with self._echoes:
            return self._echoes.wait_for(lambda: self._echo_seen >= echo, timeout_s)

    def _note_echo(self, frames: list) -> None:
        if self._echo_seen >= self._echo_wanted:
            return  # nothing awaited: nothing decoded
        try:
            msg = codec.decode(frames)
        except ProtocolError:
            return  # the process's own read says why
        if isinstance(msg, Heartbeat) and msg.echo > self._echo_seen:
            with self._echoes:
                self._echo_seen = msg.echo
                self._echoes.notify_all()

    def _send(self, msg: protocol.Message) -> None:
        try:
            transport.send(self._sock, msg)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to the scheduler: %s", msg.OP, exc.strerror)

    def _relay(self, frames: list) -> None:
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("could not send a message to the scheduler: %s", exc.strerror)
