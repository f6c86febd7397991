"""Spans of time when something besides training ran on the machines: the scheduler's own
evaluations, the servers' checkpoint writes. Steps that overlap one are not measured by the
dynamic-batching controller: on a shared host they ran slower for a reason that passes at
once, and a window's median need not absorb them.

Pure: times are the scheduler's clock (time.monotonic), passed in.
"""

from collections import deque

KEPT = 16  # the newest spans kept: a report overlaps only a recent one
SLACK_S = 0.05  # a report reaches the scheduler this long after its step at most (a queue, a slow link)


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
