"""Joins a push that came in parts (buckets a worker sent while its backward pass
still ran) back into one push for the shard core. Pure logic, no I/O.

The parts are kept as received (no copy into a shard-sized buffer, no shard-sized
allocation per push): the joined push carries them as (offset, values) segments
(server/segments.py).

A connection has at most one push in assembly. Its parts must agree on everything
but their place, stay inside the shard and not overlap, and be at most
protocol.MAX_PARTS; the push is complete when they cover the shard. A part of a
later step replaces an unfinished push (a worker goes on only once its push was
whole, so that one never will be). A refused part changes nothing. A whole push
of batch 0 for the same step (the worker found its gradient not finite) voids the
parts.

With `check`, each part's sum of squares is taken as it arrives, while the later
parts are still on the wire, so that the core need not check the joined push again
before it applies it: the parts' sums add up to the push's, so it is flat.all_finite's
test of the whole push, up to rounding (float32 parts only: a narrow dtype is checked
once widened).
"""

import bisect
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from omnips.flat import FLOAT32_MAX, square_sum
from omnips.protocol import MAX_PARTS, Push


class PartRefused(Exception):
    def __init__(self, code: str, text: str):
        super().__init__(f"{code}: {text}")
        self.code, self.text = code, text


@dataclass
class _Open:
    first: Push  # its fields, as every later part must repeat them
    segments: list  # (offset, values) of the parts so far, in arrival order
    spans: list = field(default_factory=list)  # their [start, end), sorted: an overlap is found by bisection
    filled: int = 0
    squares: float = 0.0  # the parts' sums of squares so far (inf or nan: a value is not finite)


class Joined(NamedTuple):
    push: Push  # the first part's fields, as a whole push (offset and whole 0)
    segments: list  # (offset, values) tiling the shard
    finite: bool  # every part was checked and finite: the push needs no check of its own


def _key(p: Push) -> tuple:
    return p.rank, p.step, p.version, p.batch, p.gen


class Assembler:
    def __init__(self, size: int, max_open: int, check: bool = False):
        self.size = size
        self.check = check
        self.max_open = max_open  # connections with a push in assembly: each holds its parts' frames
        self._open: dict[bytes, _Open] = {}
        self.joined = 0  # pushes completed from parts

    def feed(self, peer: bytes, part: Push) -> Joined | None:
        """The complete push once `part` fills the shard, else None; PartRefused for a
        part that does not fit (nothing changes then)."""
        if part.whole != self.size:
            raise PartRefused("bad_length", f"a part of a shard of {part.whole} values, this one holds {self.size}")
        entry = self._open.get(peer)
        lo, hi = part.offset, part.offset + part.data.size
        if entry is not None and part.step > entry.first.step:
            entry = None  # a worker starts a step only once its last push was whole: that one never will be
        if entry is None:
            if peer not in self._open and len(self._open) >= self.max_open:
                raise PartRefused("busy", f"{self.max_open} pushes are already being assembled")
        elif _key(part) != _key(entry.first) or part.data.dtype != entry.first.data.dtype:
            raise PartRefused("bad_part", f"a part of worker {part.rank}'s step {part.step} while its step "
                                          f"{entry.first.step} is incomplete")
        elif _overlaps(entry.spans, lo, hi):
            raise PartRefused("bad_part", f"worker {part.rank}'s step {part.step} already has values in "
                                          f"[{lo}, {hi})")
        elif len(entry.segments) >= MAX_PARTS:  # each held part costs a frame and a bisected insert
            raise PartRefused("bad_part", f"worker {part.rank}'s step {part.step} is in more than {MAX_PARTS} "
                                          "parts")
        if entry is None:
            self._open.pop(peer, None)
            entry = self._open[peer] = _Open(part, [])
        entry.segments.append((lo, part.data))
        bisect.insort(entry.spans, (lo, hi))
        entry.filled += hi - lo
        if self.check:
            entry.squares += square_sum(part.data)
        if entry.filled < self.size:
            return None
        del self._open[peer]
        self.joined += 1
        finite = self.check and entry.squares <= FLOAT32_MAX  # (nan and inf are not)
        # the values travel in the segments; the push keeps their dtype
        return Joined(replace(entry.first, data=entry.first.data[:0], offset=0, whole=0), entry.segments, finite)

    def void(self, peer: bytes, push: Push) -> None:
        """A whole push from `peer` came: parts of the same step it was sending are void."""
        entry = self._open.get(peer)
        if entry is not None and (entry.first.rank, entry.first.step) == (push.rank, push.step):
            del self._open[peer]

    def forget(self, rank: int) -> None:
        """Worker `rank` left the job: what it was sending will never be complete."""
        self._open = {peer: e for peer, e in self._open.items() if e.first.rank != rank}

    def clear(self) -> None:
        self._open.clear()

    @property
    def open(self) -> int:
        return len(self._open)


def _overlaps(spans: list, lo: int, hi: int) -> bool:
    """Whether [lo, hi) meets any of the sorted, disjoint `spans`: only its neighbours can."""
    i = bisect.bisect_left(spans, (lo, hi))
    return (i > 0 and spans[i - 1][1] > lo) or (i < len(spans) and spans[i][0] < hi)
