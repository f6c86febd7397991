"""server.outbox over real sockets: a peer that pushes without reading its last reply is
found out (and not waited for again), and the shard moves to fresh buffers once for a
reply that stays queued, not once per push; and the server's loop refusing such a peer's
pushes. In-process (inproc) a message stays queued until the peer reads it: over tcp or
ipc, until the peer's own ZeroMQ queue is full too."""

import contextlib
import threading

import numpy as np
import pytest
import zmq
from helpers import poll_until
from shard_helpers import PEERS, make_core, push

from omnips import codec, protocol
from omnips.leaving import Leaving
from omnips.protocol import Error, Params, Pull, Shutdown
from omnips.server import checkpointer, service
from omnips.server.outbox import Outbox

GRACE_S = 0.3


class Waits:
    """Wraps a tracker to record the timeouts it was waited with."""

    def __init__(self, tracker, seen: list):
        self.tracker, self.seen = tracker, seen

    def wait(self, timeout):
        self.seen.append(timeout)
        return self.tracker.wait(timeout)

    @property
    def done(self):
        return self.tracker.done


@pytest.fixture
def wire():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind("inproc://outbox")
    peers = {}
    for name in (b"reads", b"never"):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, name)
        d.connect("inproc://outbox")
        peers[name] = d
    try:
        yield router, peers
    finally:
        ctx.destroy(linger=0)


def _reply(router, outbox: Outbox, peer: bytes, seen: list):
    """A zero-copy, tracked reply (a shard) to `peer`, as the server sends one."""
    router.send(peer, zmq.SNDMORE)
    tracker = router.send(np.ones(1 << 16, dtype=np.float32), copy=False, track=True)
    outbox.add(peer, Waits(tracker, seen))
    return tracker


def test_a_peer_that_has_not_read_its_last_reply_is_found_out_and_then_not_waited_for(wire):
    router, peers = wire
    outbox, seen = Outbox(GRACE_S), []
    trackers = {peer: _reply(router, outbox, peer, seen) for peer in peers}
    assert peers[b"reads"].poll(5000)
    peers[b"reads"].recv_multipart()
    trackers[b"reads"].wait(5)  # (its thread learns it a little late)
    assert not outbox.unread(b"reads")
    assert not outbox.suspected(b"never")
    seen.clear()
    assert outbox.unread(b"never") and outbox.suspected(b"never")
    assert seen[0] > 0  # waited for: a sent reply's tracker learns of it a little late
    seen.clear()
    assert outbox.unread(b"never")
    assert seen == [0.0]  # found out before: not waited for again
    assert not outbox.unread(b"stranger")  # no reply was ever sent to it
    assert peers[b"never"].poll(5000)
    peers[b"never"].recv_multipart()
    trackers[b"never"].wait(5)  # (its thread learns it a little late)
    assert not outbox.unread(b"never") and not outbox.suspected(b"never")  # it read at last: waited for again
    _reply(router, outbox, b"never", seen)
    seen.clear()
    assert outbox.unread(b"never") and seen[0] > 0


def test_a_reply_that_stays_queued_moves_the_shard_once(wire):
    router, peers = wire
    outbox, seen, detached = Outbox(GRACE_S), [], []
    _reply(router, outbox, b"never", seen)
    assert outbox.settle(lambda: detached.append(1))
    assert detached == [1]
    # the queued reply aliases the old buffers: changing the new ones needs no wait and no copy
    seen.clear()
    assert not outbox.settle(lambda: detached.append(2))
    assert detached == [1] and seen == []
    # a peer found not reading is not waited for before the shard moves
    assert outbox.unread(b"never")
    tracker = _reply(router, outbox, b"reads", seen)
    assert peers[b"reads"].poll(5000)
    peers[b"reads"].recv_multipart()
    tracker.wait(5)
    assert not outbox.settle(lambda: detached.append(3))
    _reply(router, outbox, b"never", seen)
    seen.clear()
    assert outbox.settle(lambda: detached.append(4))
    assert detached == [1, 4] and seen == [0.0]


def test_replies_that_leave_within_the_grace_keep_the_shard_where_it_is(wire):
    router, peers = wire
    outbox, seen = Outbox(GRACE_S), []
    tracker = _reply(router, outbox, b"reads", seen)
    assert peers[b"reads"].poll(5000)
    peers[b"reads"].recv_multipart()
    tracker.wait(5)
    assert not outbox.settle(lambda: pytest.fail("moved the shard for a reply that left"))
    assert not outbox.unread(b"reads")


def _decoded(sock, copy=True) -> protocol.Message:
    """The next message `sock` receives (10 s at most); with copy=False its data is where ZeroMQ received it."""
    assert sock.poll(10_000), "no answer from the server"
    return codec.decode(sock.recv_multipart(copy=copy))


@contextlib.contextmanager
def serving(linked, core, tmp_path, *names):
    """The server's loop on `core` in a thread, a DEALER connected (inproc) for each of
    `names`. Yields the sockets and stop(), which ends the loop with a Shutdown and returns
    what the loop returned (AssertionError if it has not ended 10 s later; None if it
    raised); the sockets stay open until the block is left."""
    _, send, _, _ = linked  # (the link's clock stands still: the scheduler is never taken for silent)
    writer = checkpointer.ShardWriter(tmp_path, 0, 0, core.n)
    ctx = zmq.Context()
    ended = []
    loop = None

    def stop():
        send(Shutdown(ok=True))
        loop.join(10)
        assert not loop.is_alive(), "the server's loop did not end within 10 s"
        return ended[0] if ended else None

    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind("inproc://shard")
        socks = [ctx.socket(zmq.DEALER) for _ in names]
        for sock, name in zip(socks, names):
            sock.setsockopt(zmq.IDENTITY, name)
            sock.connect("inproc://shard")
        def run():
            try:
                ended.append(service._loop(router, linked[0], core, writer, None, Leaving(), "server 0"))
            except BaseException as exc:  # stop() returns it: the test says why, not only that it waited
                ended.append(exc)
                raise

        loop = threading.Thread(target=run, daemon=True)  # (a loop that does not end must not keep pytest from exiting)
        loop.start()
        yield socks, stop
    finally:
        if loop is not None and loop.is_alive():
            stop()
        ctx.destroy(linger=0)


def test_the_server_refuses_pushes_from_a_peer_that_does_not_read_and_tells_it_once(linked, tmp_path):
    n = 1 << 16  # values: a reply large enough to go zero-copy, tracked
    core = make_core(mode="asp", n=n, num_workers=2, init=np.zeros(n, dtype=np.float32))
    with serving(linked, core, tmp_path, PEERS[0], PEERS[1]) as ((honest, rogue), stop):
        grad = np.full(n, 0.5, dtype=np.float32)
        for step in range(3):  # the rogue reads nothing until the loop has ended
            rogue.send_multipart(codec.encode(push(1, step, grad)))
        # held (the shard never gets there): once it is, the three pushes before it were handled
        rogue.send_multipart(codec.encode(Pull(request=9, at=1000)))
        poll_until(lambda: core._pulls.entries or None, 10, "the rogue's pull was not held")
        honest.send_multipart(codec.encode(push(0, 0, grad)))
        assert isinstance(_decoded(honest), Params)  # served, the rogue's reply still queued
        assert stop() == 0
        answers = [_decoded(rogue) for _ in range(2)]
        assert not rogue.poll(0)  # (inproc: what the loop sent before it ended is here)
    params, refused = answers
    assert isinstance(params, Params) and params.step == 0  # the first push was taken
    assert isinstance(refused, Error) and refused.code == "unread"  # told once, not for the third push too
    assert core.updates == 2 and core.version == 2  # its first push and the honest one's
    assert core.detached == 1  # the rogue's queued reply kept the old buffers: one copy


def test_snapshot_replies_queued_unread_share_one_copy_of_the_values(linked, tmp_path):
    """Inproc hands the receiver the sender's buffer: replies that share a copy arrive at one address."""
    n = 1 << 16
    core = make_core(mode="asp", n=n, num_workers=2, init=np.zeros(n, dtype=np.float32))
    grad = np.full(n, 0.5, dtype=np.float32)
    held = {1: 8, 2: 3}  # version -> pulls waiting for it, released together by the step that reaches it
    with serving(linked, core, tmp_path, PEERS[0], PEERS[1]) as ((honest, puller), stop):
        for version, count in held.items():
            for _ in range(count):
                puller.send_multipart(codec.encode(Pull(request=version, at=version)))
        poll_until(lambda: len(core._pulls.entries) == 11 or None, 10, "the pulls were not held")
        for step in range(2):
            honest.send_multipart(codec.encode(push(0, step, grad)))
            assert isinstance(_decoded(honest), Params)
        assert stop() == 0
        # (inproc: all sent before the loop ended are here; read without a copy, at their address)
        answers = [_decoded(puller, copy=False) for _ in range(11)]
        replies = {v: [a.data for a in answers if a.version == v] for v in held}
        assert {v: len(r) for v, r in replies.items()} == held
        for data in replies.values():
            assert all(np.shares_memory(data[0], d) for d in data[1:])  # one copy for all of them
        one, two = replies[1][0], replies[2][0]
        assert not np.shares_memory(one, two)  # the step changed the values: a copy of its own
        assert not np.array_equal(one, two) and np.array_equal(two, core.values)
