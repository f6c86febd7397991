"""A client's view of all parameter servers: one DEALER per server, replies gathered
with a poller (a DEALER connected to several peers would round-robin).

Workers use the blocking calls (`init`, `pull`, `push_pull`); the scheduler sends
pulls and feeds replies in from its own poll loop (`send_pull`, `decode_reply`).
"""

import math
import time
from dataclasses import dataclass

import numpy as np
import zmq

from . import codec, protocol, security, transport
from .batching import BatchPlan
from .protocol import Ack, Error, Init, Params, ProtocolError, Pull, Push
from .wire import WireDtype, name_of


_NOTHING = np.zeros(0, dtype=np.float32)
FLOAT32 = WireDtype("float32")  # init, pulls and their replies: exact state


class ServerError(RuntimeError):
    """A server refused a request, sent garbage, or did not answer in time."""

    def __init__(self, text: str, code: str = "server"):
        super().__init__(text)
        self.code = code


@dataclass
class Exchange:
    """What one round with every server brought back."""

    versions: list[int]
    plan: BatchPlan | None  # the newest batch plan, if a server attached one
    held_s: float  # the longest a server held our request (barrier wait)
    elapsed_s: float  # first send to last reply


class ServerGroup:
    def __init__(self, ctx: zmq.Context, endpoints: list[str], ranges: list, timeout_s: float,
                 on_wait=None, tick_s: float = 1.0, keys: security.Keys | None = None, wire: WireDtype = FLOAT32,
                 on_refusal=None):
        """`on_wait()` is called about every `tick_s` while a call waits for servers (a
        worker checks on the scheduler there); `on_refusal(error)` with a server's refusal
        (a ServerError), which is raised unless it returns True. Either returning True
        interrupts the group: the wait returns at once, and so does every later one, with
        nothing (None, False), and nothing more is sent (a worker abandons its step and
        these connections). `wire`: the job's wire dtype, that of the gradients pushed and
        of the replies to them."""
        if len(endpoints) != len(ranges):
            raise ValueError("one shard range per server endpoint is needed")
        self.endpoints = list(endpoints)
        self.ranges = [(int(lo), int(hi)) for lo, hi in ranges]
        self.timeout_s = timeout_s
        self.socks = []
        for ep in self.endpoints:
            sock = transport.socket(ctx, zmq.DEALER)
            transport.connect(sock, ep, keys)
            self.socks.append(sock)
        self.versions = [0] * len(self.socks)
        self._poller = zmq.Poller()
        for sock in self.socks:
            self._poller.register(sock, zmq.POLLIN)
        self._request = 0
        self._upto: dict[int, int] = {}  # shard -> values of its reply in parts that have arrived
        # the request whose replies are being read: its id, where its values go, in what dtype they come
        self._rest_answers: tuple[int, int] | None = None
        self._rest_into: np.ndarray | None = None
        self._rest_wire = FLOAT32
        self._on_wait, self._on_refusal = on_wait, on_refusal
        self._tick_s = tick_s
        self.interrupted = False
        self._gathering: tuple[float, dict] | None = None  # (since, shards answered) of the request being read
        self.wire = wire

    # -- blocking calls (workers) -------------------------------------------------
    def init(self, values: np.ndarray) -> Exchange | None:
        """Worker 0 hands every server its initial shard."""
        if self.interrupted:
            return None
        for sock, (lo, hi) in zip(self.socks, self.ranges):
            transport.send(sock, Init(rank=0, data=values[lo:hi]))
        return self._gather(Ack, None, None)

    def pull(self, into: np.ndarray, gen: int = -1, at: int | None = None) -> Exchange | None:
        """Fetch every shard into `into` (waits while servers are not initialised; with
        `gen`, until the step being collected runs that plan: BSP joins; with `at`, at
        that version)."""
        if self.interrupted:
            return None
        self._request += 1
        for sock in self.socks:
            transport.send(sock, Pull(request=self._request, at=at, gen=gen))
        return self._gather(Params, (self._request, -1), into)

    def push_pull(self, rank: int, step: int, grads: np.ndarray, batch: int, gen: int,
                  into: np.ndarray) -> Exchange | None:
        """Push each shard's gradient slice (none with batch 0: a dropped gradient); each
        reply carries the updated shard. `grads` is in the wire dtype (WireDtype.narrow)."""
        for s, (lo, hi) in enumerate(self.ranges):
            self.push(s, lo, hi, Push(rank=rank, step=step, version=0, batch=batch, gen=gen, data=grads))
        return self.collect(step, into)

    def push(self, s: int, lo: int, hi: int, head: Push, track: bool = False) -> zmq.MessageTracker | None:
        """Send `head.data[lo:hi]` (flat positions inside shard `s`) with head's fields: as
        the shard's whole push, or as a part of it; batch 0 sends no values. The values go
        zero-copy: with `track`, the tracker says when they may change again. A reply still
        arriving in parts is read whole first: a server takes a push only from a worker that
        has read its last reply (parts that no layer's forward pass waits for, such as an
        unused parameter's, may still be on their way)."""
        if not self.complete():
            return None
        slo, shi = self.ranges[s]
        whole = (lo, hi) == (slo, shi) or not head.batch
        msg = Push(rank=head.rank, step=head.step, version=self.versions[s], batch=head.batch, gen=head.gen,
                   data=head.data[lo:hi] if head.batch else _NOTHING,
                   offset=0 if whole else lo - slo, whole=0 if whole else shi - slo, reply_part=head.reply_part)
        return transport.send(self.socks[s], msg, track=track)

    def collect(self, step: int, into: np.ndarray, early: bool = False) -> Exchange | None:
        """Every shard's reply to this step's push, written into `into`. With `early`, it
        returns once every shard has begun its answer: the parts still to come are read by
        `wait_for` (the next forward pass, layer by layer) or `complete`."""
        ex = self._gather(Params, (-1, step), into, self.wire)
        return ex if early or ex is None or self.complete() else None

    def wait_for(self, lo: int, hi: int) -> bool:
        """Until flat values [lo, hi) of the reply being read have arrived (False: interrupted)."""
        def arrived():
            return all(slo + self._upto.get(s, shi - slo) >= min(hi, shi) for s, (slo, shi) in enumerate(self.ranges)
                       if slo < hi and lo < shi)
        return not self.interrupted and (not self._upto or arrived() or self._pump(arrived))

    def complete(self) -> bool:
        """Until the reply being read has arrived whole (False: interrupted)."""
        return not self.interrupted and (not self._upto or self._pump(lambda: not self._upto))

    def _gather(self, want: type, answers: tuple[int, int] | None, into: np.ndarray | None,
                wire: WireDtype = FLOAT32) -> Exchange | None:
        """The first answer of every shard to the pull request or push step `answers` (a Params'
        (request, step)); Params values, expected in `wire`, into `into`; None when interrupted."""
        if not self.complete():  # a reply still arriving in parts comes before the next one
            return None
        start = time.perf_counter()
        self._rest_answers, self._rest_into, self._rest_wire = answers, into, wire
        got = {}
        self._gathering = (time.monotonic(), got)
        try:
            if not self._pump(lambda: len(got) == len(self.socks), want, got):
                return None
        finally:
            self._gathering = None
        params = [msg for msg in got.values() if isinstance(msg, Params)]
        plan = max((msg.plan for msg in params if msg.plan is not None), key=lambda p: p.gen, default=None)
        held = max((msg.held_s for msg in params), default=0.0)
        return Exchange(list(self.versions), plan, held, time.perf_counter() - start)

    def waiting(self) -> tuple[float, list[int]] | None:
        """While a call waits for the servers' first answers: for how long, and the server
        ranks that have not answered (on_wait tells the scheduler)."""
        if self._gathering is None:
            return None
        since, got = self._gathering
        return time.monotonic() - since, [s for s in range(len(self.socks)) if s not in got]

    def _pump(self, done, want: type | None = None, got: dict | None = None) -> bool:
        """Read replies until done(): the later parts of replies in parts and, given `got`,
        each shard's first answer (of type `want`) to the request being read, into `got`.
        False when the group is interrupted (by on_wait or on_refusal) instead."""
        answers, into = self._rest_answers, self._rest_into
        deadline = time.monotonic() + self.timeout_s
        tick = time.monotonic() + self._tick_s
        while not done():
            if self.interrupted:
                return False
            now = time.monotonic()
            if now >= deadline:
                names = ", ".join(self.name(s) for s in range(len(self.socks))
                                  if got is not None and s not in got or s in self._upto)
                raise ServerError(f"no answer from {names} within {self.timeout_s:g} s", "timeout")
            if now >= tick:  # every tick, also while stray messages keep the poll busy
                self.interrupted = self._on_wait is not None and bool(self._on_wait())
                tick = time.monotonic() + self._tick_s
                continue
            events = dict(self._poller.poll(max(1, math.ceil(1000 * (min(deadline, tick) - now)))))
            for s, sock in enumerate(self.socks):
                if sock not in events:
                    continue
                msg = self._decode(s, transport.recv_frames(sock))
                if isinstance(msg, Error):
                    self._refused(self._refusal(s, msg))
                    break
                if s in self._upto:  # a reply in parts: nothing else can come before its end
                    if not isinstance(msg, Params) or _answers(msg) != answers or not msg.whole:
                        raise ServerError(f"{self.name(s)} broke off a reply in parts", "protocol")
                    if msg.version != self.versions[s]:
                        raise ServerError(f"{self.name(s)} sent a part at version {msg.version} in a reply "
                                          f"at {self.versions[s]}", "bad_version")
                    self._accept_part(s, msg, self._upto[s])
                    continue
                if (got is None or s in got or not isinstance(msg, want)
                        or answers is not None and _answers(msg) != answers):
                    continue  # a late answer to an earlier, abandoned request: read and dropped
                if isinstance(msg, Params):
                    if msg.version < self.versions[s]:  # a shard's versions only grow, unless restored
                        self._refused(ServerError(f"{self.name(s)} answered at version {msg.version} after "
                                                  f"{self.versions[s]}", "bad_version"))
                        break
                    if msg.whole:
                        self._accept_part(s, msg, 0)
                    else:
                        self.accept(s, msg, into, self._rest_wire)
                got[s] = msg
        return True

    def _refused(self, error: ServerError) -> None:
        """A server's refusal, or a shard gone back: raised, unless on_refusal takes it."""
        if self._on_refusal is None or not self._on_refusal(error):
            raise error
        self.interrupted = True

    def _accept_part(self, s: int, msg: Params, upto: int) -> None:
        """A part of a reply, due at `upto`: the first (0) opens the reply, once it is taken."""
        lo, hi = self.ranges[s]
        if msg.whole != hi - lo or msg.offset != upto:
            raise ServerError(f"{self.name(s)} sent values at {msg.offset} of {msg.whole} where "
                              f"{upto} of {hi - lo} were due", "bad_length")
        self._take(s, msg, upto, self._rest_into, self._rest_wire)
        end = upto + msg.data.size
        if end == hi - lo:
            self._upto.pop(s, None)
        else:
            self._upto[s] = end

    def name(self, s: int) -> str:
        """Server `s` for a message: its shard's rank and the address used (a unix socket
        on this host says little by itself)."""
        return f"server {s} at {self.endpoints[s]}"

    def close(self) -> None:
        """Drop the connections and whatever they still hold (a rewind abandons them)."""
        for sock in self.socks:
            sock.close(linger=0)

    # -- pieces the scheduler's poll loop uses too --------------------------------
    def send_pull(self, request: int, at: int | None) -> None:
        self.broadcast(Pull(request=request, at=at))

    def broadcast(self, msg: protocol.Message) -> None:
        for sock in self.socks:
            transport.send(sock, msg)

    def decode_reply(self, s: int, frames: list) -> protocol.Message:
        """Server s's message; a refusal (an Error) raised as a ServerError."""
        msg = self._decode(s, frames)
        if isinstance(msg, Error):
            raise self._refusal(s, msg)
        return msg

    def _decode(self, s: int, frames: list) -> protocol.Message:
        try:
            return codec.decode(frames)
        except ProtocolError as exc:
            raise ServerError(f"{self.name(s)} sent a bad message: {exc}", "protocol") from None

    def _refusal(self, s: int, msg: Error) -> ServerError:
        return ServerError(f"{self.name(s)} refused: {msg.code}: {msg.text}", msg.code)

    def accept(self, s: int, msg: Params, into: np.ndarray | None, wire: WireDtype = FLOAT32) -> None:
        """Take a shard's values into `into` (float32), expecting them in `wire`."""
        lo, hi = self.ranges[s]
        if msg.whole or msg.data.size != hi - lo:
            raise ServerError(f"{self.name(s)} sent {msg.data.size} values for a shard of {hi - lo}",
                              "bad_length")
        self._take(s, msg, 0, into, wire)

    def _take(self, s: int, msg: Params, at: int, into: np.ndarray | None, wire: WireDtype) -> None:
        """Shard s's values from `at` on (a whole reply, or a part of one), expected in `wire`."""
        if msg.data.dtype != wire.dtype:
            raise ServerError(f"{self.name(s)} sent {name_of(msg.data)} values, expected {wire.name}",
                              "bad_dtype")
        if into is not None:
            lo = self.ranges[s][0] + at
            wire.widen(msg.data, into[lo:lo + msg.data.size])
        self.versions[s] = msg.version


def _answers(msg: Params) -> tuple[int, int]:
    return msg.request, msg.step

