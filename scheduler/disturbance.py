"""Spans of time when something besides training ran on the machines: the scheduler's own
evaluations, the servers' checkpoint writes. Steps that overlap one are not measured by the
dynamic-batching controller: on a shared host they ran slower for a reason that passes at
once, and a window's median need not absorb them. Unless they are seen not to (Effect).

Pure: times are the scheduler's clock (time.monotonic), passed in.
"""

import statistics
from collections import deque

KEPT = 16  # the newest spans kept: a report overlaps only a recent one
SLACK_S = 0.05  # a report reaches the scheduler this long after its step at most (a queue, a slow link)
JUDGED = 9  # the newest disturbed steps that say whether disturbances slow the workers
MIN_JUDGED = 5  # fewer say nothing: their steps stay unmeasured
HARMLESS = 0.05  # disturbed steps at most this much slower than their windows, at the median, were not slowed


class Disturbances:
    def __init__(self):
        self._spans: deque[tuple[float, float]] = deque(maxlen=KEPT)

    def add(self, start: float, end: float) -> None:
        self._spans.append((start, end))

    def touches(self, now: float, took_s: float) -> bool:
        """Whether a step reported at `now` that took `took_s` from its start to its report
        (compute, network and wait) may have overlapped a span. A report read late, queued
        while the scheduler evaluated, counts as overlapping: it is read at the span's end."""
        start = now - took_s - SLACK_S
        return any(s < now and start < e for s, e in self._spans)


class Effect:
    """Whether the disturbances slow the workers' steps, as measured: each disturbed step's time
    over its worker's window's median (`note`), the newest JUDGED of them. Where the evaluations
    run on another machine or another core they slow nothing, and leaving their steps out only
    delays what the windows see: under CPU quotas 70 of 400 reports overlapped an evaluation
    (by case, at the median 0.955-0.991 of the same worker's other steps at its batch), and a
    neighbour's CPU hog that began and ended at evaluations (every 11th step) was re-planned
    for two steps later and, at its end, a whole window later. Such steps are measured once
    MIN_JUDGED of them, at the median, ran within HARMLESS of their windows, and no longer
    once they run slower by twice that."""

    def __init__(self):
        self._ratios: deque[float] = deque(maxlen=JUDGED)
        self.median = 1.0  # the judged steps' median time over their windows'
        self.harmless = False

    @property
    def judged(self) -> int:
        return len(self._ratios)

    def note(self, ratio: float) -> None:
        self._ratios.append(ratio)
        self.median = statistics.median(self._ratios)
        # measured from within HARMLESS, unmeasured again past twice it: a median at the bound
        # (a neighbour's hog made one worker's steps noisy) would turn measuring on and off
        self.harmless = bool(self.judged >= MIN_JUDGED and self.median <= 1 + HARMLESS * (1 + self.harmless))
