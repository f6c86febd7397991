"""A step's gradient on its way to the servers: bucket by bucket while backward still
runs (communication overlaps computation), or shard by shard after it; and the
servers' answer, which then comes in parts of the same size, first layers first:
the next forward pass starts as soon as its first layers' values are in.

Backward hooks send each bucket as soon as every parameter in it has its final
gradient, checking it is finite first (in the job's wire dtype, into which it is
narrowed). The bucket that would complete a shard is held back until the whole
gradient is known to be finite: a server then either gets the step's whole gradient
or, with a batch-0 push, learns it was dropped (the parts it holds are void). Sends
are zero-copy and tracked: the gradient buffer is only overwritten (a step redone
after running out of memory) once they are out.

Hooks send from backward's own thread, which is the calling thread on the CPU; on
CUDA the gradients only reach the host buffer after backward, so there the buckets
go after it, as they do when an emulated device pads the compute phase (its
gradients exist only once the emulated time has passed).
"""

import functools
import logging
from dataclasses import replace

import zmq

from omnips.flat import FlatModel
from omnips.protocol import MAX_PARTS, Push
from omnips.servers import FLOAT32, ServerError, ServerGroup
from omnips.wire import WireDtype

from .buckets import BucketPlan


class Pusher:
    def __init__(self, flat: FlatModel, ranges: list, bucket_values: int, live: bool,
                 wire: WireDtype = FLOAT32):
        self.flat = flat
        self.wire = wire
        self._wire_grads = wire.buffer(flat.size)  # what pushes carry, narrowed (None: flat.grads itself)
        self.ranges = ranges
        self.live = live and bucket_values > 0
        self.plan = BucketPlan(flat.spans, flat.size, ranges, bucket_values if self.live else 0)
        if self.live and self.plan.bucket_values > bucket_values:
            logging.getLogger("omnips.worker").warning(
                "buckets of %d values instead of the %d asked for: a shard's push may be in %d parts at most",
                self.plan.bucket_values, bucket_values, MAX_PARTS)
        self.finite = True
        self._armed = False
        self._servers: ServerGroup | None = None
        self._head: Push | None = None
        self._trackers: list[zmq.MessageTracker] = []
        if self.live:
            for i, p in enumerate(flat.trained):
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, i))
            for module in flat.module.modules():
                reach = flat.reach(module)
                if reach is not None:
                    module.register_forward_pre_hook(functools.partial(self._before_forward, *reach))

    def begin(self, servers: ServerGroup, rank: int, step: int, batch: int, gen: int) -> None:
        """A new step's gradient is about to be computed."""
        self._servers = servers
        wire = self.flat.grads if self._wire_grads is None else self._wire_grads
        self._head = Push(rank=rank, step=step, version=0, batch=batch, gen=gen, data=wire,
                          reply_part=self.plan.bucket_values)
        self.plan.start()
        self.finite = True
        self._armed = False  # (a step abandoned in its backward, by a rewind, left it armed)
        self._trackers = []

    def final_pass(self) -> None:
        """The next backward makes the gradients final (the trainer calls this, after the
        forward pass). What is still arriving of the last reply (parts that no layer's
        forward waited for, an unused parameter's) is read first: a server takes a push
        only from a worker that has read its last reply, and reading here rather than in
        a backward hook keeps what the scheduler may send meanwhile (a rewind) outside
        backward."""
        if self.live:
            self._servers.complete()
        self.plan.again()
        self._armed = self.live

    def settle(self) -> None:
        """The gradients are about to be computed again: stop, and let what was sent leave."""
        self._armed = False
        timeout_s = self._servers.timeout_s
        for tracker in self._trackers:
            try:
                tracker.wait(timeout_s)
            except zmq.NotDone:
                raise ServerError(f"a gradient bucket stayed queued for {timeout_s:g} s: a server takes nothing",
                                  "timeout") from None
        self._trackers = []

    def _before_forward(self, lo: int, hi: int, _module, _inputs) -> None:
        """A layer's forward pass needs its values of the reply still arriving in parts."""
        if self._servers is not None:
            self._servers.wait_for(lo, hi)

    def _on_grad(self, i: int, _param) -> None:
        if not self._armed:
            return
        self.flat.settle(i)
        for b in self.plan.ready(i):
            if not self.plan.completes_shard(b):
                self._send(b)

    def _send(self, b: int) -> None:
        if self.finite and self._finite(b):
            self._push(b)
        else:
            self.finite = False  # nothing more goes out: the step is dropped at finish

    def _finite(self, b: int) -> bool:
        """Whether bucket b arrives finite (in the wire dtype: float16 has a narrower range)."""
        bk = self.plan.buckets[b]
        return self.wire.finite(self.flat.grads[bk.lo:bk.hi])

    def _push(self, b: int) -> None:
        bk = self.plan.buckets[b]
        if self._wire_grads is not None:
            self.wire.narrow(self.flat.grads[bk.lo:bk.hi], self._wire_grads[bk.lo:bk.hi])
        tracker = self._servers.push(bk.shard, bk.lo, bk.hi, self._head, track=self.live)
        self.plan.sent[b] = True
        if tracker is not None:
            self._trackers.append(tracker)

    def finish(self) -> bool:
        """After backward (and any padding): whether the gradient is finite; if so, what
        is left of it is sent now, else nothing more is."""
        self._armed = False
        left = self.plan.unsent()
        self.finite = self.finite and all(self._finite(b) for b in left)
        for b in left if self.finite else ():
            self._push(b)
        return self.finite

    def drop(self) -> None:
        """The step's gradient is dropped: every server gets a batch-0 push."""
        for s, (lo, hi) in enumerate(self.ranges):
            self._servers.push(s, lo, hi, replace(self._head, batch=0))
