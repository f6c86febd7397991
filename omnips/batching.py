"""Batch plans: how the global batch is split among workers. Pure functions, no I/O."""

import math
from dataclasses import dataclass

import numpy as np

# the batch sizes a worker times before its first step under dynamic batching (and sizes its
# memory with): two sizes, so that their difference cancels what does not grow with the batch
PROBE_BATCHES = (2, 4)
PROBE_ROUNDS = 2  # each probe size is timed this many times, the sizes in turn; the fastest counts
PROBE_NOISE = 0.2  # how much faster than the smaller size's pass the larger's may be (noise)
PROBE_RETRIES = 2  # more rounds of PROBE_ROUNDS while the larger pass is too fast for a line


def probe_too_flat(seconds) -> bool:
    """Whether the fastest pass of the larger probe size is faster than the smaller's by more
    than PROBE_NOISE: no speed explains it (a line t = a + c*b has a, c >= 0), only noise that
    slowed every smaller pass (on a busy host one pass of a few samples can take 5x its time),
    and a line through them would take the worker for fast at large batches (its first step
    planned far too big). The other disagreement, the larger slower than their ratio allows,
    is what a CPU quota gives passes a few of its periods long, the same in every round
    (under cgroup quotas every throttled worker's passes were so, to the last retry, which
    took seconds of a short job's start): the scheduler takes their mean throughput then
    (omnips/timemodel.py), and its first window corrects the plan."""
    t_small, t_large = seconds
    return t_large < t_small * (1 - PROBE_NOISE)


def probe_times(timed, sizes) -> tuple[list[float], int, float]:
    """The probe: `timed(size)` seconds for a pass of each size, PROBE_ROUNDS times in turn, the
    fastest of each counting (noise only adds time); more rounds, PROBE_RETRIES at most, while
    the larger is too fast for a line. Also how many rounds it took, and the spread: how far a
    size's slowest pass ran over its fastest, the least over the sizes (0.5: 50 % longer; one slow
    pass is an outlier that the fastest leaves out, passes that disagree at every size are noise). Two
    rounds, not three: the slowest worker's passes delay every worker's first step (under a CPU
    quota of 0.08 cores a round took 0.55 s and a step 1.4 s), and its first measured step
    corrects the plan. (A third round where a size's two passes differ by PROBE_NOISE took every
    round allowed under quotas: passes a few quota periods long differ by more than that from
    round to round. The spread says so to the scheduler instead: scheduler/control.py's probed.)"""
    best, worst = [math.inf] * len(sizes), [0.0] * len(sizes)
    rounds = 0
    while rounds == 0 or (probe_too_flat(best) and rounds < PROBE_ROUNDS * (1 + PROBE_RETRIES)):
        for _ in range(PROBE_ROUNDS):
            times = [timed(size) for size in sizes]
            best = [min(t, u) for t, u in zip(best, times)]
            worst = [max(t, u) for t, u in zip(worst, times)]
        rounds += PROBE_ROUNDS
    return best, rounds, min(w / b - 1 for w, b in zip(worst, best))


@dataclass(frozen=True)
class BatchPlan:
    """Generation `gen` of the per-worker batch sizes (0: a vacant rank); `stop` ends the job
    (ASP). In memory and on the wire alike (inside Plan, Params, Rewind and a worker's welcome)."""

    gen: int
    batches: tuple[int, ...]
    stop: bool = False

    def check(self) -> None:
        """What the codec checks of a plan from the network, besides its fields' types."""
        if self.gen < 0:
            raise ValueError(f"plan generation must be >= 0, not {self.gen}")
        if not self.batches or min(self.batches) < 0 or not any(self.batches):
            raise ValueError(f"a plan's batches must be counts >= 0, not all 0, not {list(self.batches)[:8]!r}")

    def sized(self, num_workers: int) -> "BatchPlan":
        """This plan, for a job of `num_workers` ranks; ValueError for a plan of another size."""
        if len(self.batches) != num_workers:
            raise ValueError(f"a plan's batches for {len(self.batches)} workers, the job has {num_workers}")
        return self


def initial_batches(batching: str, global_batch: int, capacities, lo: int = 1, hi: int | None = None) -> list[int]:
    """The starting split: equal (`uniform`), else in proportion to declared capacity
    (`static`, and the start of `dynamic`), within [lo, hi], summing to `global_batch`."""
    weights = [1.0] * len(capacities) if batching == "uniform" else [float(c) for c in capacities]
    if not all(w > 0 and np.isfinite(w) for w in weights):
        raise ValueError(f"capacities must be finite and > 0: {list(capacities)}")
    # Capacities are relative: scaled to (0, 1] they keep every slope 1/w finite, whatever a
    # worker declared (5e-324 and 1e308 are both finite and > 0). A worker below 1e-12 of the
    # fastest gets the lower bound either way.
    top = max(weights)
    weights = [max(w / top, 1e-12) for w in weights]
    hi = global_batch if hi is None else hi
    real = equal_time([(0.0, 1.0 / w) for w in weights], global_batch, lo, hi)
    return integerize(real, global_batch, lo, hi)


def spread(values, ranks, n: int) -> tuple[int, ...]:
    """`values` of the workers at `ranks` placed in a vector of `n` ranks, 0 for the vacant."""
    out = np.zeros(n, dtype=np.int64)
    out[np.asarray(ranks, dtype=np.int64)] = np.asarray(values, dtype=np.int64)
    return tuple(out.tolist())


# -- the OmniLearn controller ---------------------------------------------------------
#
# Every worker's compute time per step is modelled as a line in its batch size,
# t_i(b) = a_i + c_i*b (a_i = 0 is the paper's proportional rule: throughput
# x_i = b_i / t_i stays constant). The plan gives every worker the batch that
# takes the same time T, with the batches summing to the global batch:
#     sum_i (T - a_i) / c_i = B  =>  T = (B + sum a_i/c_i) / sum 1/c_i.
# Bounds are met by water-filling: a worker whose batch would fall outside its
# bounds is held there and the others share the rest at a common T.

MEMORY_USE = 0.8  # share of a worker's free memory a plan may fill: room for the allocator and the host
BACKWARD_FACTOR = 2.0  # peak over saved activations: backward holds their gradients alongside


def memory_batch(free_bytes: int, sample_bytes: int, sharing: int = 1, limit: int = 0) -> int:
    """The largest batch a worker's memory holds: its share of the device's free memory
    (workers on one host's RAM, or one GPU, split it), at most its own `limit` when set,
    over the per-sample footprint."""
    if free_bytes < 0 or sample_bytes <= 0 or sharing < 1 or limit < 0:
        raise ValueError(f"{free_bytes} B free, {sample_bytes} B per sample, shared by {sharing}, limit {limit}: "
                         "needs bytes >= 0, a footprint > 0 and sharing >= 1")
    usable = free_bytes / sharing
    if limit:
        usable = min(usable, limit)
    return int(MEMORY_USE * usable // (BACKWARD_FACTOR * sample_bytes))


@dataclass(frozen=True)
class Decision:
    batches: tuple[int, ...] | None  # None: every change would be inside the deadband
    targets: tuple[float, ...]  # the real-valued equal-time plan
    predicted_s: float  # the slowest worker's predicted step time under `batches` (or the current ones)
    held: tuple[int, ...] | None = None  # the plan the deadband held back, if it differs from the current one
    held_s: float = math.nan  # the slowest worker's predicted step time under `held`
    rule: str = ""  # what decided, in words, where no time model's equal time did (what held the plan)


def _line_arrays(lines) -> tuple[np.ndarray, np.ndarray]:
    """(a, c) arrays from a sequence of (a_i, c_i) pairs or an (n, 2) array."""
    arr = np.asarray(lines, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def equal_time(lines, total: int, lo, hi) -> np.ndarray:
    """Real batches b_i = clip((T - a_i) / c_i, lo_i, hi_i) summing to `total`.

    Water-filling solved exactly: the sum is piecewise linear and non-decreasing in
    T, with a kink where a worker reaches a bound (T = a_i + c_i*lo_i or a_i + c_i*hi_i).
    The sum at every sorted kink (a cumulative sum) finds the segment where it meets
    `total`, so every worker inside its bounds gets the same predicted time T, O(n log n);
    O(n) when no bound binds.
    """
    a, c = _line_arrays(lines)
    lo = np.broadcast_to(np.asarray(lo, dtype=np.float64), a.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=np.float64), a.shape)
    if len(a) == 0 or np.any(c <= 0) or not np.all(np.isfinite(a)) or not np.all(np.isfinite(c)):
        raise ValueError("every time model needs a finite slope c > 0")
    if np.any(lo > hi) or lo.sum() > total or hi.sum() < total:
        raise ValueError(f"bounds cannot sum to {total}: lows sum to {lo.sum():g}, highs to {hi.sum():g}")
    # no bound binding, as usual: T from the formula above, without sorting the kinks (a sixth
    # of a decision's time at 4096 workers)
    real = ((total + (a / c).sum()) / (1.0 / c).sum() - a) / c
    if np.all((real >= lo) & (real <= hi)):
        return real
    kinks = np.concatenate([a + c * lo, a + c * hi])
    order = np.argsort(kinks, kind="stable")
    at = kinks[order]
    slope = np.cumsum(np.concatenate([1.0 / c, -1.0 / c])[order])  # a worker starts, then stops, growing with T
    # the sum at each kink; the first segment that reaches `total` ends at a kink past the one before it
    level = np.cumsum(np.concatenate([[lo.sum()], slope[:-1] * np.diff(at)]))
    past = np.flatnonzero((level[1:] >= total) & (at[1:] > at[:-1]))
    j = past[0] if len(past) else len(at) - 1  # the kink the segment starts at
    t = at[j]
    if slope[j] > 0:
        t += (total - level[j]) / slope[j]
    return np.clip((t - a) / c, lo, hi)


def integerize(real, total: int, lo, hi, lines=None, fastest: bool = False) -> list[int]:
    """Round to integers in [lo_i, hi_i] summing to `total`, each within one of `real`.
    The samples left after rounding down go to the largest remainders (ties to the
    lower index); given the workers' time models (`lines`), to the workers that one
    more sample slows least instead (ties to the largest remainder, then to the faster
    line: a smaller per-sample time, then a smaller fixed time), which makes the
    slowest worker as fast as a split within one of `real` allows (a remainder says
    nothing of time: a sample is 1 % of a big worker's step and 15 % of a 7-sample one's).
    Taking samples off goes the other way round. The last tie-break keeps a faster worker's
    batch no smaller where two lines differ by less than the times can show (fixed times
    9.46e-183 apart).

    `fastest` (with `lines`): a worker may take more than one of the samples left over (the
    split is then no longer within one of `real`), so that the slowest worker is as fast as
    any integer split makes it: two workers on a twentieth of a core, at 14.5 samples each
    beside one five times as fast at 90, took 14 and 15, and the one at 15 ran 5 % over the
    others' time a step; the fast one takes both for 1 % of its time each."""
    real = np.asarray(real, dtype=np.float64)
    lo = np.broadcast_to(np.asarray(lo, dtype=np.int64), real.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=np.int64), real.shape)
    out = np.clip(np.floor(real + 1e-9).astype(np.int64), lo, hi)
    spare = total - int(out.sum())
    step = 1 if spare > 0 else -1
    room = (out < hi) if step > 0 else (out > lo)
    remainder = -(real - out) if step > 0 else real - out
    keys = [np.arange(len(out)), remainder]
    if lines is not None:
        a, c = _line_arrays(lines)
        keys = [np.arange(len(out)), step * a, step * c, remainder]  # ties: faster first (taking off: slower)
        # the time after one sample more; or, taking samples off, the slowest first
        keys.append(a + c * (out + 1) if step > 0 else -(a + c * out))
    eligible = np.flatnonzero(room)
    if fastest and lines is not None and step > 0:
        return _fastest(out, spare, eligible, hi, c, keys)
    if len(eligible) < abs(spare):
        raise ValueError(f"no integer split of {total} within the bounds")
    out[_first(eligible, abs(spare), keys)] += step
    return out.tolist()


def _fastest(out: np.ndarray, spare: int, eligible: np.ndarray, hi: np.ndarray, c: np.ndarray,
             keys: list) -> list[int]:
    """`spare` samples added to `out`, each to the worker it slows least (integerize's `keys`,
    the time after one sample more primary; `c`: the per-sample times): as a worker's time
    grows with its batch, the samples taken are the `spare` cheapest of all k-th samples more,
    and the slowest worker's time is the least of any split. None is dearer than the
    spare-th cheapest first sample, which bounds how many each worker offers."""
    if int((hi - out)[eligible].sum()) < spare:
        raise ValueError(f"no integer split of {int(out.sum()) + spare} within the bounds")
    first = keys[-1][eligible]
    offered = np.minimum(hi - out, spare)[eligible]
    if len(eligible) >= spare > 0:
        dearest = np.partition(first, spare - 1)[spare - 1]
        within = 1 + np.floor((dearest - first) / c[eligible] + 1e-9).astype(np.int64)
        offered = np.clip(within, 0, offered)
    who = np.repeat(eligible, offered)
    k = np.arange(len(who)) - np.repeat(np.cumsum(offered) - offered, offered)  # 0 for a worker's first
    candidates = [key[who] for key in keys[:-1]] + [keys[-1][who] + c[who] * k]
    np.add.at(out, who[_first(np.arange(len(who)), spare, candidates)], 1)
    return out.tolist()


def _first(eligible: np.ndarray, k: int, keys: list) -> np.ndarray:
    """The `k` of `eligible` that come first in `np.lexsort(keys)` order (the last key
    primary), without sorting them all (a decision at 4096 workers spent a tenth of its time
    sorting): those below the k-th primary value, then the ties at it in the full order."""
    if k in (0, len(eligible)):
        return eligible[:k]
    primary = keys[-1][eligible]
    cut = np.partition(primary, k - 1)[k - 1]
    below, tied = eligible[primary < cut], eligible[primary == cut]
    tied = tied[np.lexsort([key[tied] for key in keys[:-1]])]
    return np.concatenate([below, tied[:k - len(below)]])


def decide(batches, lines, total: int, lo, hi, deadband: float, measured=None) -> Decision:
    """The next batch vector from each worker's time model (a_i, c_i: pairs or an (n, 2)
    array), or none when the change is not worth it: no worker's batch would move by
    more than `deadband` (relative; half a sample at least, so a target between two
    integers cannot flip the plan), or every move is within one sample and the step
    would not get predictably faster by more than `deadband` (noise on a small worker's
    time must not churn it between two sizes), or the slowest worker is held at its
    lower bound now and in the new plan, so that no plan can be faster and the step
    would not get faster by more than `deadband` (re-balancing the others buys nothing),
    or the workers' `measured` times at `batches` (where given) are `balanced` within
    `deadband`: then no plan is measurably faster, whatever the lines say."""
    targets = equal_time(lines, total, lo, hi)
    current = np.asarray(batches, dtype=np.float64)
    a, c = _line_arrays(lines)
    now = a + c * current
    now_s = float(now.max())
    new = integerize(targets, total, lo, hi, lines, fastest=True)
    new_batches = np.asarray(new)
    new_s = float((a + c * new_batches).max())
    if deadband > 0:
        gap = np.abs(targets - current)
        small = np.all((gap < deadband * current) | (gap <= 0.5))
        no_gain = now_s <= new_s * (1 + deadband)
        marginal = np.all(gap < np.maximum(deadband * current, 1.0)) and no_gain
        slowest = int(np.argmax(now))
        floor = np.broadcast_to(np.asarray(lo, dtype=np.float64), current.shape)[slowest]
        pinned = current[slowest] <= floor and new[slowest] <= floor and no_gain
        if small or marginal or pinned:
            rule = "inside the deadband"
        elif measured is not None and balanced(current, measured, deadband):
            rule = "measured balanced within the deadband"
        else:
            rule = ""
        if rule:
            if np.any(new_batches != current):
                return Decision(None, tuple(targets.tolist()), now_s, tuple(new), new_s, rule)
            return Decision(None, tuple(targets.tolist()), now_s, rule=rule)
    return Decision(tuple(new), tuple(targets.tolist()), new_s)


def alike(lines, batches, best_s: float, band: float) -> float | None:
    """The slowest worker's predicted time under `batches` (the uniform split) where it lies
    within `band` of `best_s` (the best plan's) and within `band` three times over of the fastest
    worker's: workers the lines cannot tell apart (under CPU quotas the probe's passes put four
    equal workers 1.5x apart). None otherwise: a worker 4x faster than 63 others moves the slowest
    worker's time by 5 % only."""
    a, c = _line_arrays(lines)
    times = a + c * np.asarray(batches, dtype=np.float64)
    slowest = float(times.max())
    return None if slowest > best_s * (1 + band) or slowest > times.min() * (1 + band) ** 3 else slowest


def balanced(batches, times, band: float) -> bool:
    """Whether the slowest of the workers' measured `times` at `batches` is within `band` of
    the step time at which their measured throughputs, each held, would share the batches
    equally: the total over their samples per second together. (Under any lines through
    positive slopes the best plan's time lies between the fastest and slowest measured, and
    this is it where times are proportional to the batch.)"""
    b, t = np.asarray(batches, dtype=np.float64), np.asarray(times, dtype=np.float64)
    return bool(t.max() <= (1 + band) * b.sum() / np.sum(b / t))
