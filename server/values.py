"""A shard's values and every buffer that aliases them: the step written in ranges, the
wire-dtype copy replies carry, read-only copies for pulls and checkpoints, and the move
to fresh buffers when queued replies still hold the old ones. Pure: no sockets.

A step's bookkeeping is done when it is taken (`take`); its values are written range
by range by `ready(hi)`, which the server calls before it sends each part of a reply,
so the first parts leave while the rest is still being updated. Ranges end at
multiples of ALIGN, so the step written in ranges is bit-for-bit the step written whole.
With --wire-dtype bfloat16 or float16, a push is widened into a float32 buffer of its
rank's (so the BSP sum stays in rank order), and replies to pushes carry the shard
narrowed into one buffer, once per version.
"""

import bisect
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from omnips import optim
from omnips.flat import aligned_empty, aligned_zeros
from omnips.job import JobSpec
from omnips.wire import WireDtype

from . import asynchrony
from .segments import ALIGN


@dataclass
class _Due:
    """A step taken whose values are not all written yet."""

    grads: list  # (weight, segments sorted by offset, their offsets): the gradient is the weighted sum, in order
    version: int  # the one the step makes
    rank: int = -1  # ASP/SSP: the worker whose push it applies
    done: int = 0  # values [0, done) hold the step
    narrow: bool = False  # a reply carries the step in the wire dtype: narrow each range too


class ShardValues:
    def __init__(self, job: JobSpec, n: int, trained: int):
        self.n, self.trained = n, trained  # local slots [0, trained) are parameters, the rest model buffers
        self.values = aligned_zeros(n)
        self._agg = aligned_zeros(n) if job.mode == "bsp" else None
        self._per_rank = job.mode == "bsp"  # a widened push waits at the barrier: one buffer per rank
        self.opt = optim.make(job, torch.from_numpy(self.values[:trained]))
        self.correction = asynchrony.make(job.async_correction if job.mode != "bsp" else "none", trained)
        self.wire = WireDtype(job.wire_dtype)
        self._widened: dict[int, np.ndarray] = {}  # float32 buffers for narrow pushes
        self._wire_values = self.wire.buffer(n)  # the shard narrowed for push replies (None: float32)
        self._wire_version: int | None = None  # the version _wire_values holds
        self._due: _Due | None = None  # the step taken whose values ready() still writes
        self.detached = 0  # times the shard moved to fresh buffers, its old ones left to queued replies
        self._writes = 0  # changes of the values: a frozen copy holds the values of one
        self._frozen: tuple[int, weakref.ref] | None = None  # (writes, the copy) while a reply holds it

    def load(self, values: np.ndarray) -> None:
        """The values replaced whole (an init, a restore)."""
        self.ready(self.n)
        np.copyto(self.values, values)
        self._writes += 1
        self._wire_version = None

    def take(self, grads: list, version: int, lr: float, decay: float | None = None, rank: int = -1) -> None:
        """An optimizer step to `version` on the weighted sum of `grads`, (weight, segments)
        pairs (with momentum `decay`, None: the recipe's; `rank`: the pushing worker in
        ASP/SSP); ready() writes its values."""
        self.ready(self.n)
        self._writes += 1
        if self.trained:
            self.opt.begin(lr, decay)
        self._due = _Due([(weight, segments, [a for a, _ in segments]) for weight, segments in grads], version, rank)

    def ready(self, hi: int) -> None:
        """Values [0, hi) hold the last step taken (and its wire-dtype copy, where a reply
        carries that)."""
        due = self._due
        if due is None or hi <= due.done:
            return
        lo, hi = due.done, min(self.n, -(-hi // ALIGN) * ALIGN)
        self._write(due.grads, lo, hi, due.rank)
        if due.narrow:
            self.wire.narrow(self.values[lo:hi], self._wire_values[lo:hi])
        due.done = hi
        if hi == self.n:
            self._due = None
            if due.narrow:
                self._wire_version = due.version

    def _write(self, grads: list, lo: int, hi: int, rank: int) -> None:
        """Values [lo, hi) of the step on `grads`: the optimizer's update, while buffer slots
        simply take the gradient's values."""
        (weight, segments, starts), *more = grads
        segments = _window(segments, starts, lo, hi)
        if more or weight != 1:  # the BSP mean of several pushes, summed in rank order
            for a, values in segments:
                np.multiply(values, weight, out=self._agg[a:a + values.size])
            agg = torch.from_numpy(self._agg)
            for weight, others, starts in more:
                for a, values in _window(others, starts, lo, hi):
                    agg[a:a + values.size].add_(torch.from_numpy(values), alpha=weight)
            segments = [(lo, self._agg[lo:hi])]
        t = self.trained
        if lo < t:
            self.correction.apply(rank, [(a, values[:t - a]) for a, values in segments if a < t], self.values,
                                  self.opt)
            self.correction.updated(lo, hi, self.values)
        for a, values in segments:
            if a + values.size > t:
                np.copyto(self.values[max(a, t):a + values.size], values[max(0, t - a):])

    def float32(self, rank: int, segments: list) -> list:
        """A push's values in float32: narrow ones (checked, so not a duplicate of a pending
        push) widened into its rank's buffer (BSP keeps it until the barrier; ASP applies it
        at once, so one buffer serves all), whole."""
        if self.wire.exact or not segments:
            return segments
        slot = rank if self._per_rank else 0
        if slot not in self._widened:
            self._widened[slot] = aligned_empty(self.n)  # once per rank, not per step
        out = self._widened[slot]
        for lo, values in segments:
            self.wire.widen(values, out[lo:lo + values.size])
        return [(0, out)]

    def frozen(self) -> np.ndarray:
        """The values as a read-only copy, taken when a snapshot reply (a pull, a joiner's
        values) or a checkpoint's state is due: a reply's receiver may never read it, so it
        cannot alias the shard, which the next step changes. What is due between two changes
        of the values shares one copy, kept only as long as one of them holds it: pulls that
        pile up unread (a flood, evaluation pulls released together) would otherwise hold a
        copy each, and a checkpoint at an evaluation's step one more."""
        self.ready(self.n)
        if self._frozen is not None and self._frozen[0] == self._writes:
            copy = self._frozen[1]()
            if copy is not None:
                return copy
        copy = self.values.copy()
        copy.flags.writeable = False
        self._frozen = (self._writes, weakref.ref(copy))
        return copy

    def narrowed(self, version: int) -> np.ndarray:
        """The shard as a reply to a push carries it: in the wire dtype, narrowed once per
        version (a step's ranges as ready() writes them). Replies alias it (zero-copy,
        tracked), as they alias `values` in float32: the server waits for them to leave
        before handling anything that can change the values."""
        if self.correction.moves_replies:  # look-ahead values, derived from the whole step
            self.ready(self.n)
            data = self.correction.reply(self.values, self.opt, version)
            if data is not self.values:
                if self.wire.exact:
                    return data
                self.wire.narrow(data, self._wire_values)
                self._wire_version = None  # it holds other values than the shard's
                return self._wire_values
        if self.wire.exact:
            return self.values
        due = self._due
        if due is not None:
            if not due.narrow:
                self.wire.narrow(self.values[:due.done], self._wire_values[:due.done])
                due.narrow = True
        elif self._wire_version != version:
            self.wire.narrow(self.values, self._wire_values)
            self._wire_version = version
        return self._wire_values

    def detach(self) -> None:
        """Move the shard to fresh buffers with the same values, leaving the current ones to
        the replies still queued that alias them (zero-copy): what changes the shard next
        cannot tear them. One copy, where waiting would hold the server up for as long as
        a receiver does not read (a worker frozen or slow)."""
        self.ready(self.n)
        values = aligned_empty(self.n)
        np.copyto(values, self.values)
        self.values = values
        self.opt.param = torch.from_numpy(values[:self.trained])  # updated in place; nothing else holds a view
        if self._wire_values is not None:  # replies in the wire dtype alias this one
            self._wire_values = self.wire.buffer(self.n)
            self._wire_version = None
        self.correction.detach()
        self.detached += 1


def _window(segments: list, starts: list[int], lo: int, hi: int) -> list:
    """The parts inside [lo, hi) of (offset, values) segments sorted by offset (`starts`): found
    by bisection, so that a step written in many ranges of a push in many parts stays linear."""
    out = []
    for i in range(max(0, bisect.bisect_right(starts, lo) - 1), len(segments)):
        a, values = segments[i]
        if a >= hi:
            break
        if a + values.size > lo:
            out.append((max(a, lo), values[max(0, lo - a):hi - a]))
    return out
