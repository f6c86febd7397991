"""Workers' compute times as lines in their batch sizes, fitted from recent measurements.

`observe(ranks, batches, seconds, noise)` takes each worker's robust time for a window at its
batch (and its step noise, which sets how far apart sizes must be for a slope: SLOPE_K);
`lines(ranks)` returns (a, c) with t(b) ~ a + c*b. With points at two or more
batch sizes far enough apart, its slope is a weighted least-squares fit's (older points
weigh less: the worker's speed may drift) and it runs through the newest point: the plan
in force is judged by what it measured, the other points only say how the time moves
with the batch (a point left by the plan, measured in a noise that has passed, kept a
worker under CPU quotas predicted 6 % faster than it ran at its batch, and the plan off
balance for good). Otherwise the line through the origin and the points' weighted mean
(a = 0: constant throughput), and for the paper's rule, a negative intercept or a fit
whose time does not grow with the batch, the one through the newest point. A size
measured again is averaged into its point, the earlier windows weighing less, and leaves
the other points as they were: a plan that holds still keeps the slope it learnt and
measures its point ever more precisely. Each point keeps two averages over the windows
measured at it: a short one (the earlier windows keep FORGET of their weight) and a long
one (REPEAT), which the fit uses. With noise independent from window to window and well
under DRIFT, the long one's error is 0.58 of the short one's (0.33 of a single
window's): the slowest of thousands of workers' errors sets a BSP step. It trails a
drifting speed by about four windows' drift where the short one trails by one; where the
two part by more than DRIFT to the same side at two measurements of the size running,
the long one restarts from the short one (one window's outlier does not restart it). A
new size ages both averages of the other points. Once a line is fitted, a size within
half MIN_SPREAD of a point is that point measured again, moved along the line: a plan
that moves by a few samples each window (thousands of workers' noise moves some every
time) averages as well as one that holds still.

A measurement far from a trustworthy prediction (near a point measured at the
speed now) means the worker's speed changed (throttling, another job on the
machine, an emulated slowdown). Such changes scale compute time as a whole, so
the older points are rescaled by the same ratio rather than thrown away: the fit
stays usable at once, and the next adjustment lands on the new equal-time plan.
A rescaled point is a guess, though (a neighbour's hog did not scale a worker's
time alike at every batch): a step near it joins the fit, as one far from every
point does. A fitted line missed by a factor FAR at
a size far from its points is wrong itself (its points were measured in a noise that
has passed): the points are dropped, and the new one starts the model again.

All workers' points live in arrays, a column each (a row per slot), so that one
decision for thousands of workers is a few numpy operations rather than a fit per
worker; reducing over a worker's few slots is then an elementwise operation on
rows (about 7x faster at 4096 workers than reducing each short row of the other layout).
"""

import math

import numpy as np

FORGET = 0.5  # weight left to older points at each new measurement
CHANGE = 0.2  # relative prediction error taken as a change of speed
FAR = 2.0  # a prediction missed by this factor, at any batch, is a change of speed
MIN_SPREAD = 0.1  # distinct batch sizes must span this fraction of the largest for a fit
# and SLOPE_K times the worker's step noise (a robust standard deviation of its steps' log times,
# `observe`'s noise): two windows' medians at sizes a few % apart differ by their noise as much as by
# the batch, and the slope through them is anything (under CPU quotas, points at 13 and 15 samples
# 1.5 % apart in time gave a worker a fixed cost of 85 % of its step and the next plan 19 samples:
# steps of 1.61 s where the plan before measured 1.18, back after 12 steps). With SLOPE_K = 3, a span
# of three step noises, the slope from two windows of three steps is within about a third.
SLOPE_K = 3.0
MIN_WEIGHT = 0.02  # points weighing less are dropped
REPEAT = 0.8  # weight left to a point's long average when its size is measured again
DRIFT = 0.03  # relative gap between a point's two averages that, twice running, is taken as drift
# points a worker can hold at once: the newest, and those a new size has aged fewer times than
# takes the heaviest (a size measured again and again weighs up to 1 / (1 - FORGET)) below
# MIN_WEIGHT; a plan that keeps going back to old sizes can hold more, and then a new size
# takes the lightest point's slot
SLOTS = 1 + math.floor(math.log(MIN_WEIGHT * (1 - FORGET)) / math.log(FORGET))


class TimeModels:
    """The time models of `n` workers: each column holds up to SLOTS points (batch, time,
    weight), weight 0 marking an empty slot; the batches in a column are distinct."""

    def __init__(self, n: int, affine: bool = True):
        self.affine = affine
        self.batch = np.zeros((SLOTS, n), dtype=np.float64)
        self.time = np.zeros((SLOTS, n), dtype=np.float64)
        self.weight = np.zeros((SLOTS, n), dtype=np.float64)
        # each point's time twice: `time` is its short average (as `weight`, the earlier windows
        # at its size keep FORGET), `steady` its long one (REPEAT; `count` its weight), which the
        # fit uses; `parted`: +-1 where the last window left the long one more than DRIFT above
        # (below) the short one, else 0
        self.steady = np.zeros((SLOTS, n), dtype=np.float64)
        self.count = np.zeros((SLOTS, n), dtype=np.float64)
        self.parted = np.zeros((SLOTS, n), dtype=np.float64)
        # 1 where the point was measured at the worker's speed now; 0 once a change rescaled it: a rescaled
        # point is the model's guess, which a step near it may miss with no change of speed (see observe)
        self.fresh = np.zeros((SLOTS, n), dtype=np.float64)
        self._lines = np.zeros((n, 2), dtype=np.float64)  # each row's (a, c), fitted when it changes
        # whether each worker holds a point (kept apart from `weight`: a decision asks it of
        # every worker several times)
        self._measured = np.zeros(n, dtype=bool)
        self._span = np.full(n, MIN_SPREAD)  # the span each worker's sizes need for a slope (see SLOPE_K)

    def reset(self, ranks) -> None:
        """Forget everything measured of `ranks` (a new worker took them)."""
        self.weight[:, ranks] = 0.0
        self._measured[ranks] = False
        self._span[ranks] = MIN_SPREAD

    def measured(self, ranks) -> np.ndarray:
        return self._measured[ranks]

    def observe(self, ranks, batches, seconds, noise=None) -> np.ndarray:
        """One measurement per rank in `ranks` (distinct); ValueError, and nothing
        changed, if any has a batch < 1 or a time that is not finite and > 0. `noise`: each
        rank's step noise as far as known (0: none known; None: as it was), which sets the span
        of sizes a slope needs (SLOPE_K). Returns which of them were taken as a change of speed
        (their history rescaled)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        b = np.asarray(batches, dtype=np.float64)
        t = np.asarray(seconds, dtype=np.float64)
        bad = ~((b >= 1) & (t > 0) & np.isfinite(t))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"a measurement needs batch >= 1 and time > 0, got ({b[i]:g}, {t[i]:g})")
        if not len(ranks):
            return np.zeros(0, dtype=bool)
        span = self._span[ranks]  # the span the line in use was fitted under (a copy)
        if noise is not None:
            self._span[ranks] = np.maximum(MIN_SPREAD, SLOPE_K * np.nan_to_num(np.asarray(noise, dtype=np.float64)))
        points = (self.weight, self.batch, self.time, self.steady, self.count, self.parted, self.fresh)
        # every worker, in order (a decision's usual call): worked on in place; else their columns
        # (take, not [:, ranks]: that returns the columns in the other memory order, slow to reduce)
        whole = len(ranks) == self.batch.shape[1] and bool(np.all(ranks == np.arange(len(ranks))))
        w, bs, ts, ss, ns, gap, fr = points if whole else (np.take(x, ranks, axis=1) for x in points)
        held = w > 0
        line = self._lines[ranks]
        predicted = line[:, 0] + line[:, 1] * b
        # near a point measured at the speed now only: under a neighbour's CPU hog, a worker's probe point at 4
        # samples, twice rescaled, predicted 0.99 s there; its steps ran 0.62, read as a change the whole
        # history was rescaled by 0.63, and the plan gave it 17 samples, then 29 (1.5 and 2.7 s a step)
        change = _near(b, bs, held & (fr > 0)) & (np.abs(t - predicted) > CHANGE * predicted)
        # far from every point a miss is the fit's error, and the point joins it; but a miss by a
        # factor FAR is no fit's error where the line is fitted, nor where a line through the
        # origin from one size (a fixed cost bends it: it under-predicts below that size and
        # over-predicts above) misses the other way: its points are wrong (measured during a
        # noise that has passed), and a worker moved off them is never measured there again to
        # correct them. They are forgotten: the new point starts the model afresh.
        low, high = FAR * t < predicted, t > FAR * predicted
        size = np.where(held, bs, 0.0).max(axis=0)
        fitted = _spread(w, bs, span)
        far = ~change & held.any(axis=0) & ((fitted & (low | high)) | (~fitted & ((b < size) & low | (b > size) & high)))
        scale = np.ones(len(ranks))
        scale[change] = t[change] / predicted[change]
        ts *= scale
        # the rescaled history rests on one window's ratio: the long average restarts from the
        # short one (its weight too), which that window's noise leaves sooner
        ss[:, change], ns[:, change], gap[:, change], fr[:, change] = ts[:, change], w[:, change], 0.0, 0.0
        w[:, far], ns[:, far] = 0.0, 0.0
        held = w > 0
        cols = np.arange(len(ranks))
        distance = np.where(held, np.abs(bs - b), np.inf)
        nearest = np.argmin(distance, axis=0)
        # with a fitted line, a size within half MIN_SPREAD of a point is that point measured
        # again, moved along the line: a plan that moves by a few samples each window keeps
        # averaging over windows and keeps the far points its slope comes from (at least twice
        # as far apart); without a fit only the same size is, so that the sizes can spread out
        reach = np.where(_spread(w, bs, span), 0.5 * MIN_SPREAD * bs[nearest, cols], 0.0) if self.affine else 0.0
        again = distance[nearest, cols] <= reach
        moved = np.where(again, scale * line[:, 1] * (b - bs[nearest, cols]), 0.0)
        ts[nearest, cols] += moved
        ss[nearest, cols] += moved
        # a new size ages the other points (both averages: one at a size the plan comes back to
        # after a while must not outweigh the windows then); a size measured again only its own
        # point, so that a steady plan neither forgets its slope nor loses its average over windows
        w[:, ~again] *= FORGET
        ns[:, ~again] *= FORGET
        w[w < MIN_WEIGHT] = 0.0
        # the slot of the point measured again, else an empty one, else the lightest point's
        slot = np.where(again, nearest, np.argmin(w, axis=0))
        kept = np.where(again, FORGET * w[slot, cols], 0.0)
        merged = (kept * ts[slot, cols] + t) / (kept + 1.0)
        # the long average: many windows shrink the timing noise, but trail a drifting speed,
        # which the short one follows: a gap beyond DRIFT to the same side as the last window's
        # is a drift (one window's outlier leaves one such gap), and the long one restarts from
        # the short one, with its weight
        held_n = np.where(again, REPEAT * ns[slot, cols], 0.0)
        steady = (held_n * ss[slot, cols] + t) / (held_n + 1.0)
        side = np.sign(steady - merged) * (np.abs(steady - merged) > DRIFT * merged)
        drifted = (side != 0) & (np.where(again, gap[slot, cols], 0.0) == side)
        steady = np.where(drifted, merged, steady)
        held_n = np.where(drifted, kept, held_n)
        w[slot, cols], bs[slot, cols], ts[slot, cols], fr[slot, cols] = kept + 1.0, b, merged, 1.0
        ss[slot, cols], ns[slot, cols], gap[slot, cols] = steady, held_n + 1.0, np.where(drifted, 0.0, side)
        if not whole:
            for stored, worked in zip(points, (w, bs, ts, ss, ns, gap, fr)):
                stored[:, ranks] = worked
        self._measured[ranks] = True
        self._lines[ranks] = _fit(w, bs, ss, b, steady, self._span[ranks]) if self.affine else _through_origin(b, steady)
        return change

    def trusted_at(self, ranks, batches) -> np.ndarray:
        """Whether a miss at each batch is a speed change rather than the batch change
        itself (or a poor fit): only near a size already measured, at the speed now (not a
        point a change rescaled). Elsewhere a new point simply joins the fit."""
        cols = np.arange(self.batch.shape[1])[ranks]  # a mask or indices, as the other methods take
        return _near(np.asarray(batches, dtype=np.float64), np.take(self.batch, cols, axis=1),
                     (np.take(self.weight, cols, axis=1) > 0) & (np.take(self.fresh, cols, axis=1) > 0))

    def lines(self, ranks) -> np.ndarray:
        """(a, c) of each rank's current model, an (n, 2) array; every rank needs an observation."""
        if not np.all(self.measured(ranks)):
            raise ValueError("no measurement yet")
        return self._lines[ranks]

    def observe_probes(self, points: dict[int, tuple[list, list]], pooled: set[int],
                       shaped: set[int] = frozenset()) -> None:
        """Workers' probe passes (rank -> their sizes and seconds), each a point; a rank in
        `pooled` gets one point instead, their samples in their time: its mean throughput.
        Ranks in `shaped` (their passes ran under a CPU quota) take lines of one shape: a fixed
        cost of the median of their own lines' fixed costs in samples' time (those pooled have
        no say), each at its mean throughput over its passes. Passes a few quota periods long
        run at what the periods give them: equal workers' own lines through 2 and 4 samples put
        their fixed costs at -2 % to 7 % of a 32-sample step (HL2-HL8's up to 12 %), and the
        start plan as far apart; the same program on equal CPUs scales both costs alike."""
        points = dict(points)
        ratios = [_ratio(*points[rank]) for rank in sorted(shaped) if rank not in pooled]
        ratio = float(np.median([r for r in ratios if r is not None] or [0.0]))
        for rank in shaped:
            sizes, seconds = points[rank]
            per_sample = sum(seconds) / (ratio * len(sizes) + sum(sizes))
            points[rank] = (sizes, [per_sample * (ratio + b) for b in sizes])
        ranks = sorted(points)
        one = [rank for rank in ranks if rank in pooled and rank not in shaped]
        if one:
            self.observe(one, [sum(points[r][0]) for r in one], [sum(points[r][1]) for r in one])
        lined = [rank for rank in ranks if rank not in one]
        for j in range(min((len(points[r][0]) for r in lined), default=0)):
            self.observe(lined, [points[r][0][j] for r in lined], [points[r][1][j] for r in lined])

    def planning_lines(self, ranks: np.ndarray, batches: np.ndarray, global_batch: int) -> np.ndarray:
        """The lines to plan `ranks` by (their `batches` now), an (n, 2) array. One never measured
        (it just joined) is taken to be as fast as the typical measured worker (the median line);
        when none is, each to need the same time for its current batch (the plan is taken as
        balanced), or for an equal share of `global_batch` when it has none."""
        measured = self.measured(ranks)
        lines = np.zeros((len(ranks), 2))
        if measured.any():
            lines[measured] = self.lines(ranks[measured])
            if not measured.all():
                lines[~measured] = np.median(lines[measured], axis=0)
            return lines
        lines[:, 1] = 1.0 / np.where(batches > 0, batches, global_batch / len(ranks))
        return lines

    def predict(self, ranks, batches) -> np.ndarray:
        line = self.lines(ranks)
        return line[:, 0] + line[:, 1] * np.asarray(batches, dtype=np.float64)


def _ratio(sizes, seconds) -> float | None:
    """A line's fixed cost over its time per sample (0 below the origin), least squares through
    a worker's passes; None where the time does not grow with the batch."""
    if len(set(sizes)) < 2:
        return None
    c, a = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(seconds, dtype=np.float64), 1)
    return max(a, 0.0) / c if c > 0 else None


def off_by(seconds: float, expected: float, factor: float) -> bool:
    """Whether a time missed `expected` by more than `factor`, either way (half the time is as
    far off as twice it); a nan `expected` misses nothing."""
    return seconds > factor * expected or factor * seconds < expected


def off_by_far(seconds: float, predicted: float) -> bool:
    """Whether a step missed a prediction by more than a factor FAR, either way: no line's
    error, wherever the line was fitted (TimeModels.observe drops the points it makes wrong)."""
    return off_by(seconds, predicted, FAR)


def _near(b: np.ndarray, bs: np.ndarray, held: np.ndarray) -> np.ndarray:
    """Whether each column holds a point within MIN_SPREAD of its batch in `b`."""
    return np.any(held & (np.abs(b - bs) <= MIN_SPREAD * bs), axis=0)


def _spread(w: np.ndarray, bs: np.ndarray, span: np.ndarray) -> np.ndarray:
    """Whether each column holds two or more points spanning `span` (its own, a fraction) of its largest
    batch: enough for a fit."""
    held = w > 0
    top = np.where(held, bs, 0.0).max(axis=0)
    bottom = np.where(held, bs, np.inf).min(axis=0)
    return (np.count_nonzero(held, axis=0) >= 2) & (top - bottom >= span * top)


def _through_origin(nb: np.ndarray, nt: np.ndarray) -> np.ndarray:
    return np.stack([np.zeros(len(nb)), nt / nb], axis=1)


def _fit(w: np.ndarray, bs: np.ndarray, ts: np.ndarray, nb: np.ndarray, nt: np.ndarray,
         span: np.ndarray) -> np.ndarray:
    """Each column's (a, c) from its points (weights `w`, batches `bs`, times `ts`), its
    newest point (`nb`, `nt`) and the span its sizes need for a slope."""
    out = _through_origin(nb, nt)
    fit = _spread(w, bs, span)
    # too close together for a slope: through the origin and the points' weighted mean, every
    # recent window counting rather than the newest alone (the sizes differ by under MIN_SPREAD,
    # so a fixed cost bends it little); sizes further apart than that but not than the worker's
    # span: through the origin and the newest point (`out` as it is), which a fixed cost would
    # put off the weighted mean
    few = ~_spread(w, bs, MIN_SPREAD)  # (none of them fitted: a worker's span is MIN_SPREAD at least)
    wf = np.compress(few, w, axis=1)  # (compress, not [:, few]: see observe)
    out[few, 1] = (wf * np.compress(few, ts, axis=1)).sum(axis=0) / (wf * np.compress(few, bs, axis=1)).sum(axis=0)
    if not fit.any():
        return out
    if not fit.all():
        w, bs, ts = (np.compress(fit, x, axis=1) for x in (w, bs, ts))
    total = w.sum(axis=0)
    mb = (w * bs).sum(axis=0) / total
    mt = (w * ts).sum(axis=0) / total
    db = bs - mb
    wdb = w * db
    c = (wdb * (ts - mt)).sum(axis=0) / (wdb * db).sum(axis=0)
    nbf, ntf = nb[fit], nt[fit]  # the slope from every point, the line through the newest (see the docstring)
    line = np.stack([ntf - c * nbf, c], axis=1)
    low = line[:, 0] < 0  # a negative intercept: through the origin and the newest point
    line[low] = _through_origin(nbf[low], ntf[low])
    # time not growing with batch (a starved process takes its time whatever its batch): no usable
    # slope, the line through the newest point; a slope a millionth of the mean time per sample is
    # none either (equal_time would give it ~1e19 samples per second)
    flat = c <= 1e-6 * mt / mb
    line[flat] = _through_origin(nbf[flat], ntf[flat])
    out[fit] = line
    return out
