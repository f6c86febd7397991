"""server.outbox over real sockets: a peer that pushes without reading its last reply is
found out (and not waited for again), and the shard moves to fresh buffers once for a
reply that stays queued, not once per push."""

import numpy as np
import pytest
import zmq

from server.outbox import Outbox

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
    assert not outbox.unread(b"reads")
    assert not outbox.suspected(b"never")
    assert outbox.unread(b"never") and outbox.suspected(b"never")
    assert seen[-1] > 0  # waited for: a sent reply's tracker learns of it a little late
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
    _reply(router, outbox, b"reads", seen)
    assert peers[b"reads"].poll(5000)
    peers[b"reads"].recv_multipart()
    assert not outbox.settle(lambda: detached.append(3))
    _reply(router, outbox, b"never", seen)
    seen.clear()
    assert outbox.settle(lambda: detached.append(4))
    assert detached == [1, 4] and seen == [0.0]


def test_replies_that_leave_within_the_grace_keep_the_shard_where_it_is(wire):
    router, peers = wire
    outbox, seen = Outbox(GRACE_S), []
    _reply(router, outbox, b"reads", seen)
    assert peers[b"reads"].poll(5000)
    peers[b"reads"].recv_multipart()
    assert not outbox.settle(lambda: pytest.fail("moved the shard for a reply that left"))
    assert not outbox.unread(b"reads")
