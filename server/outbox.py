"""Replies that left zero-copy and may still be queued, by peer.

A push's reply aliases the shard (zero-copy, tracked): before the shard changes, the
server waits a little for such replies to leave and otherwise moves the shard to fresh
buffers (ShardCore.detach), leaving the old ones to the replies. A worker reads its last
reply whole before it pushes again (ServerGroup.push and Pusher.final_pass make sure), so
a push from a peer whose own reply is still queued here means a peer that does not read
(its ZeroMQ stopped taking messages: its queue is full, or its process stopped). Each of
its pushes would otherwise pin one more shard copy, until this side's queue filled, and
hold every other worker up for the wait. Such pushes are refused instead, until its
replies have left: it costs the server one copy and two waits at most.
"""

import time

import zmq


class Outbox:
    def __init__(self, grace_s: float):
        self.grace_s = grace_s  # the longest a wait for a queued reply lasts
        self._queued: dict[bytes, list[tuple[int, zmq.MessageTracker]]] = {}  # peer -> (epoch, tracker)
        self._epoch = 0  # the shard's buffers: a detach starts a new epoch, which no queued reply aliases
        self._unread: set[bytes] = set()  # peers found with a reply still queued when they pushed

    def add(self, peer: bytes, tracker: zmq.MessageTracker) -> None:
        if not tracker.done:  # (a small reply is copied, and its tracker done at once)
            self._queued.setdefault(peer, []).append((self._epoch, tracker))

    def unread(self, peer: bytes) -> bool:
        """Whether a reply to `peer` is still queued, after waiting up to grace_s for it to
        leave (the tracker learns of a sent reply from another thread, a little late). A
        peer found so once is not waited for again until its replies have left."""
        entries = self._queued.get(peer)
        if entries:
            deadline = time.monotonic() + (0.0 if peer in self._unread else self.grace_s)
            if not _left(entries, deadline):
                self._unread.add(peer)
                return True
            del self._queued[peer]
        self._unread.discard(peer)
        return False

    def suspected(self, peer: bytes) -> bool:
        """Whether `peer` was found not reading and has not caught up since."""
        return peer in self._unread

    def settle(self, detach) -> bool:
        """Before the shard changes: wait up to grace_s for the queued replies that alias its
        buffers (not for a peer that does not read); when one has not left, call `detach`
        (the shard moves to fresh buffers) and start a new epoch. Whether it detached."""
        deadline = time.monotonic() + self.grace_s
        stuck = any(not _left([e for e in entries if e[0] == self._epoch],
                              time.monotonic() if peer in self._unread else deadline)
                    for peer, entries in self._queued.items())
        if stuck:
            detach()
            self._epoch += 1
        self._queued = {peer: kept for peer, entries in self._queued.items()
                        if (kept := [e for e in entries if not e[1].done])}
        self._unread &= self._queued.keys()  # a peer gone: its queued replies were dropped
        return stuck


def _left(entries: list, deadline: float) -> bool:
    """Whether every tracker in `entries` is done by `deadline`."""
    for _, tracker in entries:
        try:
            tracker.wait(max(0.0, deadline - time.monotonic()))
        except zmq.NotDone:
            return False
    return True
