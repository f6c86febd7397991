"""A client's view of all parameter servers: one DEALER per server, replies gathered
with a poller (a DEALER connected to several peers would round-robin).

Workers use the blocking calls (`init`, `pull`, `push_pull`); the scheduler sends
pulls and feeds replies in from its own poll loop (`send_pull`, `decode_reply`).
"""

import time
from dataclasses import dataclass

import numpy as np
import zmq

from . import protocol, security, transport
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
    plan: dict | None  # the newest batch plan, if a server attached one
    held_s: float  # the longest a server held our request (barrier wait)
    elapsed_s: float  # first send to last reply


class ServerGroup:
    def __init__(self, ctx: zmq.Context, endpoints: list[str], ranges: list, timeout_s: float,
                 on_wait=None, tick_s: float = 1.0, keys: security.Keys | None = None, wire: WireDtype = FLOAT32):
        """`on_wait()` is called about every `tick_s` while a call waits for servers (a
        worker checks on the scheduler there); it may raise to abandon the wait. `wire`:
        the job's wire dtype, that of the gradients pushed and of the replies to them."""
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
        self._req = 0
        self._on_wait = on_wait
        self._tick_s = tick_s
        self.wire = wire

    # -- blocking calls (workers) -------------------------------------------------
    def init(self, values: np.ndarray) -> None:
        """Worker 0 hands every server its initial shard."""
        for sock, (lo, hi) in zip(self.socks, self.ranges):
            transport.send(sock, Init(rank=0, data=values[lo:hi]))
        self._gather(Ack, None, None)

    def pull(self, into: np.ndarray, gen: int = -1, at: int | None = None) -> Exchange:
        """Fetch every shard into `into` (waits while servers are not initialised; with
        `gen`, until the step being collected runs that plan: BSP joins; with `at`, at
        that version)."""
        self._req += 1
        for sock in self.socks:
            transport.send(sock, Pull(req=self._req, at=at, gen=gen))
        return self._gather(Params, self._req, into)

    def push_pull(self, rank: int, step: int, grads: np.ndarray, batch: int, gen: int,
                  into: np.ndarray) -> Exchange:
        """Push each shard's gradient slice (none with batch 0: a dropped gradient); each
        reply carries the updated shard. `grads` is in the wire dtype (WireDtype.narrow)."""
        for s, (sock, (lo, hi)) in enumerate(zip(self.socks, self.ranges)):
            transport.send(sock, Push(rank=rank, step=step, ver=self.versions[s], batch=batch, gen=gen,
                                      data=grads[lo:hi] if batch else _NOTHING))
        return self._gather(Params, step, into, self.wire)

    def _gather(self, want: type, req: int | None, into: np.ndarray | None,
                wire: WireDtype = FLOAT32) -> Exchange:
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(len(self.socks)))
        plan, held = None, 0.0
        while waiting:
            left = deadline - time.monotonic()
            events = dict(self._poller.poll(int(min(left, self._tick_s) * 1000))) if left > 0 else {}
            if not events and left > self._tick_s:
                if self._on_wait is not None:
                    self._on_wait()
                continue
            if not events:
                names = ", ".join(self.endpoints[s] for s in sorted(waiting))
                raise ServerError(f"no answer from server(s) {names} within {self.timeout_s:g} s", "timeout")
            for s, sock in enumerate(self.socks):
                if sock not in events:
                    continue
                msg = self.decode_reply(s, transport.recv_frames(sock))
                if s not in waiting or not isinstance(msg, want) or (req is not None and msg.req != req):
                    continue  # a late answer to an earlier, abandoned request: read and dropped
                if isinstance(msg, Params):
                    self.accept(s, msg, into, wire)
                    plan = msg.plan if _newer(msg.plan, plan) else plan
                    held = max(held, msg.held_s)
                waiting.discard(s)
        return Exchange(list(self.versions), plan, held, time.perf_counter() - start)

    def close(self) -> None:
        """Drop the connections and whatever they still hold (a rewind abandons them)."""
        for sock in self.socks:
            sock.close(linger=0)

    # -- pieces the scheduler's poll loop uses too --------------------------------
    def send_pull(self, req: int, at: int | None) -> None:
        self.broadcast(Pull(req=req, at=at))

    def broadcast(self, msg: protocol.Message) -> None:
        for sock in self.socks:
            transport.send(sock, msg)

    def decode_reply(self, s: int, frames: list) -> protocol.Message:
        try:
            msg = protocol.decode(frames)
        except ProtocolError as exc:
            raise ServerError(f"server {self.endpoints[s]} sent a bad message: {exc}", "protocol") from None
        if isinstance(msg, Error):
            raise ServerError(f"server {self.endpoints[s]} refused: {msg.code}: {msg.text}", msg.code)
        return msg

    def accept(self, s: int, msg: Params, into: np.ndarray | None, wire: WireDtype = FLOAT32) -> None:
        """Take a shard's values into `into` (float32), expecting them in `wire`."""
        lo, hi = self.ranges[s]
        if msg.data.size != hi - lo:
            raise ServerError(f"server {self.endpoints[s]} sent {msg.data.size} values for a shard of {hi - lo}",
                              "bad_length")
        if msg.data.dtype != wire.dtype:
            raise ServerError(f"server {self.endpoints[s]} sent {name_of(msg.data)} values, expected {wire.name}",
                              "bad_dtype")
        if into is not None:
            wire.widen(msg.data, into[lo:hi])
        self.versions[s] = msg.version


def _newer(plan: dict | None, than: dict | None) -> bool:
    return plan is not None and (than is None or plan.get("gen", -1) > than.get("gen", -1))
