"""A worker's compute time as a line in its batch size, fitted from recent measurements.

`observe(b, t)` takes a window's robust time t at batch b; `line()` returns
(a, c) with t(b) ~ a + c*b. With points at two or more batch sizes far enough
apart, it is a weighted least-squares fit (older points weigh less: the
worker's speed may drift); otherwise, or for the paper's rule, the line through
the origin and the newest point (a = 0: constant throughput).

A measurement far from a trustworthy prediction means the worker's speed changed
(throttling, another job on the machine, an emulated slowdown). Such changes
scale compute time as a whole, so the older points are rescaled by the same
ratio rather than thrown away: the fit stays usable at once, and the next
adjustment lands on the new equal-time plan.
"""

from dataclasses import dataclass, field

import numpy as np

FORGET = 0.5  # weight left to older points at each new measurement
CHANGE = 0.2  # relative prediction error taken as a change of speed
MIN_SPREAD = 0.1  # distinct batch sizes must span this fraction of the largest for a fit
MIN_WEIGHT = 0.02  # points weighing less are dropped


@dataclass
class TimeModel:
    affine: bool = True
    points: dict[int, list[float]] = field(default_factory=dict)  # batch -> [time, weight]
    newest: tuple[int, float] | None = None

    def observe(self, batch: int, seconds: float) -> None:
        if batch < 1 or not seconds > 0 or not np.isfinite(seconds):
            raise ValueError(f"a measurement needs batch >= 1 and time > 0, got ({batch}, {seconds})")
        if self.trusted_at(batch):
            predicted = self.predict(batch)
            if abs(seconds - predicted) > CHANGE * predicted:
                ratio = seconds / predicted
                for point in self.points.values():
                    point[0] *= ratio
        for point in self.points.values():
            point[1] *= FORGET
        self.points = {b: p for b, p in self.points.items() if p[1] >= MIN_WEIGHT}
        self.points[batch] = [seconds, 1.0]
        self.newest = (batch, seconds)

    def _fitted(self) -> bool:
        bs = list(self.points)
        return self.affine and len(bs) >= 2 and max(bs) - min(bs) >= MIN_SPREAD * max(bs)

    def trusted_at(self, batch: int) -> bool:
        """Whether a miss at `batch` is a speed change rather than the batch change itself
        (or a poor fit): only near a size already measured. Elsewhere a new point simply
        joins the fit."""
        return any(abs(batch - b) <= MIN_SPREAD * b for b in self.points)

    def line(self) -> tuple[float, float]:
        """(a, c) of the current model; needs at least one observation."""
        if self.newest is None:
            raise ValueError("no measurement yet")
        b0, t0 = self.newest
        proportional = (0.0, t0 / b0)
        if not self._fitted():
            return proportional
        bs = np.array(list(self.points), dtype=np.float64)
        ts, ws = np.array(list(self.points.values())).T
        mb, mt = np.average(bs, weights=ws), np.average(ts, weights=ws)
        c = np.sum(ws * (bs - mb) * (ts - mt)) / np.sum(ws * (bs - mb) ** 2)
        a = mt - c * mb
        if c <= 0:
            return proportional  # time not growing with batch: no usable slope
        if a < 0:
            return (0.0, float(np.average(ts / bs, weights=ws)))
        return (float(a), float(c))

    def predict(self, batch: int) -> float:
        a, c = self.line()
        return a + c * batch
