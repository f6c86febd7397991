"""Batch plans, the starting split, and the OmniLearn controller's pure arithmetic:
the equal-time plan (`equal_time`), its integer split (`integerize`) and `decide`."""

import math

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from omnips import codec, protocol
from omnips.batching import (PROBE_RETRIES, PROBE_ROUNDS, BatchPlan, Decision, alike, balanced, decide, equal_time,
                             initial_batches, integerize, probe_times, probe_too_flat)
from omnips.protocol import Plan, ProtocolError

FAST = settings(max_examples=40, deadline=None)


# -- a reference solution --------------------------------------------------------------

def water_fill(lines, total, lo, hi):
    """The equal-time plan, computed independently: find T with
    sum_i clip((T - a_i)/c_i, lo_i, hi_i) = total by bisection (the sum is monotone in T),
    then solve T exactly for the workers left strictly inside their bounds."""
    a = np.array([ln[0] for ln in lines], dtype=np.float64)
    c = np.array([ln[1] for ln in lines], dtype=np.float64)
    lo = np.broadcast_to(np.asarray(lo, dtype=np.float64), a.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=np.float64), a.shape)
    t_lo, t_hi = float((a + c * lo).min()) - 1.0, float((a + c * hi).max()) + 1.0
    for _ in range(200):
        mid = (t_lo + t_hi) / 2
        if np.clip((mid - a) / c, lo, hi).sum() < total:
            t_lo = mid
        else:
            t_hi = mid
    b = np.clip((t_hi - a) / c, lo, hi)
    free = (b > lo) & (b < hi)
    if free.any():
        t = (total - b[~free].sum() + (a[free] / c[free]).sum()) / (1.0 / c[free]).sum()
        b[free] = (t - a[free]) / c[free]
    return b


def check_equal_time(lines, total, lo, hi, real):
    """What the equal-time plan must be: bounds, the exact sum, equal times for the
    unpinned workers, and pins that are consistent with that time (a worker held at
    its lower bound is no faster than the rest, one held at its upper bound no slower)."""
    a = np.array([ln[0] for ln in lines])
    c = np.array([ln[1] for ln in lines])
    lo = np.broadcast_to(np.asarray(lo, dtype=np.float64), a.shape)
    hi = np.broadcast_to(np.asarray(hi, dtype=np.float64), a.shape)
    assert real.shape == a.shape
    assert np.all(real >= lo - 1e-9) and np.all(real <= hi + 1e-9), (real, lo, hi)
    assert math.isclose(real.sum(), total, rel_tol=1e-9, abs_tol=1e-9), (real, total)
    times = a + c * real
    tol = 1e-9 * max(1.0, float(np.abs(times).max()))
    free = (real > lo + 1e-9) & (real < hi - 1e-9)
    if free.any():
        level = times[free]
        assert level.max() - level.min() <= tol, ("unpinned workers must take the same time", real, times)
        t = float(level.mean())
        at_lo, at_hi = ~free & np.isclose(real, lo) & (lo < hi), ~free & np.isclose(real, hi) & (lo < hi)
        assert np.all(times[at_lo] >= t - tol), ("a worker held at its lower bound is faster than the rest",
                                                 real, times)
        assert np.all(times[at_hi] <= t + tol), ("a worker held at its upper bound is slower than the rest",
                                                 real, times)
    np.testing.assert_allclose(real, water_fill(lines, total, lo, hi), rtol=1e-7, atol=1e-7 * total)


# -- strategies ------------------------------------------------------------------------

LINE = st.tuples(st.one_of(st.just(0.0), st.floats(0.0, 100.0)), st.floats(0.01, 10.0))


@st.composite
def problems(draw, per_worker_hi=True, binding_hi=True):
    """(lines, total, lo, hi) with feasible bounds; hi a list by worker (or the total)."""
    lines = draw(st.lists(LINE, min_size=1, max_size=8))
    n = len(lines)
    lo = draw(st.integers(1, 5))
    if not binding_hi:
        total = draw(st.integers(lo * n, 600))
        return lines, total, lo, total
    if per_worker_hi:
        hi = draw(st.lists(st.integers(lo, lo + 300), min_size=n, max_size=n))
    else:
        hi = [draw(st.integers(lo, lo + 300))] * n
    total = draw(st.integers(lo * n, sum(hi)))
    return lines, total, lo, (hi if per_worker_hi else hi[0])


def faster(lines, j, i):
    """Worker j is at least as fast as worker i at every batch size, and not identical."""
    (aj, cj), (ai, ci) = lines[j], lines[i]
    return aj <= ai and cj <= ci and (aj, cj) != (ai, ci)


# -- equal_time ----------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(problem=problems(binding_hi=False))
def test_equal_time_with_only_the_lower_bound_binding(problem):
    lines, total, lo, hi = problem
    check_equal_time(lines, total, lo, hi, equal_time(lines, total, lo, hi))


@settings(max_examples=150, deadline=None)
@given(problem=problems())
def test_equal_time_with_per_worker_upper_bounds(problem):
    """Regression: the old pin-one-side-at-a-time loop missed the total (every worker
    pinned) or kept a fast worker at its lower bound once upper bounds bound."""
    lines, total, lo, hi = problem
    check_equal_time(lines, total, lo, hi, equal_time(lines, total, lo, hi))


@settings(max_examples=80, deadline=None)
@given(problem=problems(per_worker_hi=False))
def test_equal_time_with_a_common_upper_bound(problem):
    lines, total, lo, hi = problem
    check_equal_time(lines, total, lo, hi, equal_time(lines, total, lo, hi))


def test_equal_time_sums_to_the_total_when_every_worker_is_pinned_once():
    # worker 1 has a big overhead, worker 0 is capped: the answer is [40, 24]
    real = equal_time([(0.0, 1.0), (100.0, 1.0)], 64, 1, 40)
    assert real.sum() == pytest.approx(64)
    np.testing.assert_allclose(real, [40, 24])


def test_equal_time_does_not_leave_a_fast_worker_at_its_lower_bound():
    lines = [(10.0, 0.5), (0.0, 0.5), (0.0, 5.0)]
    real = equal_time(lines, 8, 1, 4)
    # T ~ 10.909: worker 0 takes (T - 10)/0.5, worker 1 is capped at 4, worker 2 takes T/5
    np.testing.assert_allclose(real, water_fill(lines, 8, 1, 4))
    assert decide([3, 3, 2], lines, 8, 1, 4, 0.05).batches == (2, 4, 2)  # slowest step 11, not 15


def test_equal_time_with_a_worker_exactly_at_its_bound():
    """Regression: a worker whose equal-time batch is its bound up to rounding (a fitted
    slope of 0.4999999999999999 puts worker 3 at 1.0) made the old loop pin and free it in
    turn until it raised RuntimeError."""
    lines = [(0.0, 10.5 / 19), (0.0, 10.5 / 11), (0.0, 50.5), (10.0, 0.4999999999999999)]
    np.testing.assert_allclose(equal_time(lines, 32, 1, 32), [19, 11, 1, 1])
    assert decide([19, 11, 1, 1], lines, 32, 1, 32, 0.05).batches is None


def test_equal_time_known_answers():
    # no overheads: in proportion to speed (1/c)
    np.testing.assert_allclose(equal_time([(0, 1), (0, 1), (0, 2)], 10, 0, 10), [4, 4, 2])
    # overheads: T = (B + sum a/c) / sum 1/c = (12 + 10) / 2 = 11
    np.testing.assert_allclose(equal_time([(10, 1), (0, 1)], 12, 1, 12), [1, 11])
    np.testing.assert_allclose(equal_time([(2, 1), (0, 1)], 12, 1, 12), [5, 7])
    # a worker whose equal-time batch is below the minimum is held there
    np.testing.assert_allclose(equal_time([(100, 1), (0, 1), (0, 1)], 12, 2, 12), [2, 5, 5])
    # an upper bound that binds hands the rest to the others
    np.testing.assert_allclose(equal_time([(0, 1), (0, 1), (0, 4)], 18, 1, [4, 12, 12]), [4, 11.2, 2.8])


@pytest.mark.parametrize("lines, total, lo, hi", [
    ([(0, 1), (0, 1)], 10, 6, 10),  # the minima exceed the total
    ([(0, 1), (0, 1)], 10, 1, 4),  # the maxima cannot hold it
    ([(0, 1), (0, 1)], 10, 1, [9, 0]),  # a worker whose maximum is below the minimum
    ([(0, 1), (0, 1)], 10, [1, 6], [9, 5]),
    ([(0, 1), (0, 0)], 10, 1, 10),  # no slope
    ([(0, 1), (0, -1)], 10, 1, 10),
    ([(0, 1), (float("nan"), 1)], 10, 1, 10),
    ([(0, 1), (0, float("inf"))], 10, 1, 10),
])
def test_equal_time_refuses_what_cannot_work(lines, total, lo, hi):
    with pytest.raises(ValueError):
        equal_time(lines, total, lo, hi)
    with pytest.raises(ValueError):
        decide([5, 5], lines, total, lo, hi, 0.05)


# -- integerize -------------------------------------------------------------------------

@FAST
@given(problem=problems(binding_hi=False))
def test_integerize_rounds_the_exact_plan(problem):
    lines, total, lo, hi = problem
    real = water_fill(lines, total, lo, hi)
    out = integerize(real, total, lo, hi)
    assert all(type(x) is int for x in out)
    assert sum(out) == total
    assert all(lo <= b <= hi for b in out)
    # each is the floor or the ceiling of its real batch
    assert all(math.floor(r - 1e-9) <= b <= math.ceil(r + 1e-9) for b, r in zip(out, real)), (out, real)


def test_integerize_known_splits():
    assert integerize([10 / 3] * 3, 10, 1, 10) == [4, 3, 3]  # ties go to the lower index
    assert integerize([3.5, 1.75, 1.75], 7, 1, 7) == [3, 2, 2]  # largest remainders first
    assert integerize([2.6, 2.4, 5.0], 10, 1, 10) == [3, 2, 5]
    assert integerize(np.array([3.0, 1.0]), 4, 1, 4) == [3, 1]
    assert integerize([2.9999999999, 1.0000000001], 4, 1, 4) == [3, 1]  # no spurious remainder
    assert integerize([4.6, 4.4], 9, 1, [4, 9]) == [4, 5]  # the bound wins over the remainder


@FAST
@given(problem=problems())
def test_integerize_with_time_models_makes_the_slowest_worker_as_fast_as_it_can(problem):
    """Spare samples spent by time: no spare sample can move to a worker that did not get
    one and make the slowest worker faster (so no split within one of the real plan
    has a faster slowest worker), and it is never slower than the split by remainders."""
    lines, total, lo, hi = problem
    his = np.broadcast_to(np.asarray(hi), (len(lines),))
    real = water_fill(lines, total, lo, hi)
    out = np.array(integerize(real, total, lo, hi, lines))
    assert out.sum() == total and np.all(out >= lo) and np.all(out <= his)
    assert np.all(np.floor(real - 1e-9) <= out) and np.all(out <= np.ceil(real + 1e-9))
    a, c = np.array(lines).T
    times = a + c * out
    slowest = times.max()
    assert slowest <= (a + c * np.array(integerize(real, total, lo, hi))).max() + 1e-9
    base = np.clip(np.floor(real + 1e-9), lo, his)
    for i in np.flatnonzero((out > base) & (times == slowest)):
        for j in np.flatnonzero((out == base) & (out < his)):
            moved = times.copy()
            moved[i], moved[j] = a[i] + c[i] * base[i], a[j] + c[j] * (base[j] + 1)
            assert moved.max() >= slowest - 1e-9, (lines, out, i, j)


def test_integerize_with_time_models_known_split():
    # real 22.3, 49.1, 24.6 (51.1 ms each): the largest remainder (worker 2) would take 52 ms,
    # worker 0 takes 51.5
    lines = [(40.0, 0.5), (2.0, 1.0), (2.0, 2.0)]
    real = equal_time(lines, 96, 1, 96)
    assert integerize(real, 96, 1, 96) == [22, 49, 25]
    assert integerize(real, 96, 1, 96, lines) == [23, 49, 24]
    # equal times after the extra sample: the larger remainder breaks the tie
    assert integerize([44.25, 19.75], 64, 1, 64, [(20.0, 1.0), (5.0, 3.0)]) == [44, 20]


@settings(max_examples=200, deadline=None)
@given(quarters=st.lists(st.integers(4, 40), min_size=1, max_size=24),
       slopes=st.lists(st.integers(1, 2), min_size=24, max_size=24), extra=st.integers(-3, 3),
       use_lines=st.booleans())
def test_integerize_spends_the_spare_samples_in_key_order_ties_included(quarters, slopes, extra, use_lines):
    """Against a plain sort of every worker by (time after one more sample, remainder, the
    faster line, rank): real batches in quarters and integer lines make ties common."""
    real = np.array(quarters) / 4.0
    n = len(real)
    lines = [(float(s % 2), float(s)) for s in slopes[:n]]
    base = np.floor(real + 1e-9).astype(int)  # (real >= 1)
    spare = min(max(extra, -int(np.count_nonzero(base > 1))), n)  # what one step each can spend
    total = int(base.sum()) + spare
    out = integerize(real, total, 1, total, lines if use_lines else None)
    step = 1 if spare > 0 else -1

    def key(i):
        a, c = lines[i]
        when = (a + c * (base[i] + 1) if step > 0 else -(a + c * base[i]),) if use_lines else ()
        faster = (step * c, step * a) if use_lines else ()  # (taking samples off: the slower line first)
        return when + (-(real[i] - base[i]) if step > 0 else real[i] - base[i],) + faster + (i,)

    room = [i for i in range(n) if step > 0 or base[i] > 1]
    expected = base.copy()
    expected[sorted(room, key=key)[:abs(spare)]] += step
    assert out == expected.tolist()


def fastest_possible(lines, total, lo, hi) -> float:
    """The least slowest-worker time of any integer split, found apart from integerize: the
    least of the times a worker can have at which the batches each worker fits within it
    hold `total`."""
    a, c = np.array(lines, dtype=np.float64).T
    his = np.broadcast_to(np.asarray(hi), a.shape)
    floor_s = (a + c * lo).max()
    times = sorted({float(t) for ai, ci, h in zip(a, c, his) for t in ai + ci * np.arange(lo, h + 1) if t >= floor_s})
    fits = lambda t: np.clip(np.floor((t - a) / c + 1e-9), lo, his).sum() >= total  # noqa: E731
    return next(t for t in times if fits(t))


@FAST
@given(problem=problems())
def test_integerize_fastest_makes_the_slowest_worker_as_fast_as_any_integer_split(problem):
    lines, total, lo, hi = problem
    real = water_fill(lines, total, lo, hi)
    out = np.array(integerize(real, total, lo, hi, lines, fastest=True))
    assert out.sum() == total and np.all(out >= lo) and np.all(out <= np.asarray(hi))
    a, c = np.array(lines).T
    slowest = (a + c * out).max()
    assert slowest <= fastest_possible(lines, total, lo, hi) * (1 + 1e-9)
    assert slowest <= (a + c * np.array(integerize(real, total, lo, hi, lines))).max() * (1 + 1e-9)


def test_integerize_fastest_gives_a_fast_worker_more_than_one_spare_sample():
    """Two workers on a twentieth of a core at 14.5 samples each, one 6 times as fast at 89.5:
    within one of the real split one of them takes 15 (a sample is 6 % of its step); the fast
    worker takes both spare samples instead, for 2 % of its step."""
    lines = [(0.04, 0.047), (0.04, 0.047), (0.065, 0.07), (0.02, 0.00787)]
    real = equal_time(lines, 128, 1, 128)
    assert np.allclose(real[:2], 14.5, atol=0.1)
    assert integerize(real, 128, 1, 128, lines) == [15, 14, 9, 90]
    assert integerize(real, 128, 1, 128, lines, fastest=True) == [14, 14, 9, 91]


def test_integerize_refuses_an_impossible_split():
    with pytest.raises(ValueError):
        integerize([1.5, 1.5], 3, 1, 1)
    with pytest.raises(ValueError):
        integerize([3.0, 3.0], 4, 3, 5)


# -- decide ----------------------------------------------------------------------------

@settings(max_examples=80, deadline=None)
@given(problem=problems(), data=st.data())
def test_decide_sums_exactly_within_per_worker_bounds(problem, data):
    lines, total, lo, hi = problem
    n = len(lines)
    his = hi if isinstance(hi, list) else [hi] * n
    current = data.draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    d = decide(current, lines, total, lo, hi, 0.0)  # deadband 0: always a plan
    assert isinstance(d, Decision) and d.batches is not None
    assert all(type(b) is int for b in d.batches)
    assert sum(d.batches) == total
    assert all(lo <= b <= h for b, h in zip(d.batches, his)), (d.batches, his)
    assert len(d.targets) == n


@settings(max_examples=100, deadline=None)
@given(problem=problems())
@example(problem=([(9.46e-183, 1.0), (0.0, 1.0)], 3, 1, [300, 300]))  # a tie the times cannot show: to the faster
@example(problem=([(0.0, 1.0), (0.0, 1.0), (9.46e-183, 1.0)], 7, 1, [300, 300, 300]))
def test_decide_gives_a_faster_worker_no_smaller_batch(problem):
    lines, total, lo, hi = problem
    his = hi if isinstance(hi, list) else [hi] * len(lines)
    d = decide([1] * len(lines), lines, total, lo, hi, 0.0)
    check_equal_time(lines, total, lo, hi, np.array(d.targets))
    for i in range(len(lines)):
        for j in range(len(lines)):
            if his[i] != his[j]:
                continue
            if faster(lines, j, i):
                assert d.batches[j] >= d.batches[i], (lines, his, d.batches)
            if lines[i] == lines[j]:
                assert abs(d.batches[i] - d.batches[j]) <= 1


def test_decide_faster_worker_example_under_caps():
    d = decide([21, 21, 21], [(100.0, 1.0), (99.0, 1.0), (0.0, 1.0)], 63, 1, [100, 100, 10], 0.05)
    assert d.batches == (26, 27, 10)


def test_decide_deadband():
    lines = [(0.0, 1.0), (0.0, 1.0)]
    # already balanced: nothing to do, and the prediction is for the current plan
    d = decide([32, 32], lines, 64, 1, 64, 0.05)
    assert d.batches is None and d.targets == (32.0, 32.0) and d.predicted_s == 32.0
    assert d.held is None  # nothing held back: the plan it would take is the current one
    # worker 1 is 8 % slower: targets 33.23 / 30.77, 3.8 % off: inside a 5 % deadband, outside a 3 % one
    skew = [(0.0, 1.0), (0.0, 1.08)]
    d = decide([32, 32], skew, 64, 1, 64, 0.05)
    assert d.batches is None and d.targets == pytest.approx((64 / (1 + 1 / 1.08), 64 / 1.08 / (1 + 1 / 1.08)))
    assert d.predicted_s == pytest.approx(32 * 1.08)
    # what the deadband held back, and how fast it is predicted to be
    assert d.held == (33, 31) and d.held_s == pytest.approx(33.48)
    assert decide([32, 32], skew, 64, 1, 64, 0.03).batches == (33, 31)
    assert decide([32, 32], skew, 64, 1, 64, 0.03).held is None
    # a decision outside the deadband that rounds back to the current plan is still a decision
    d = decide([33, 31], skew, 64, 1, 64, 0.0)
    assert d.batches == (33, 31)
    assert d.predicted_s == pytest.approx(max(33, 31 * 1.08))


@settings(max_examples=150, deadline=None)
@given(batches=st.lists(st.integers(1, 200), min_size=1, max_size=12), data=st.data())
def test_balanced_is_the_equal_time_plans_time_for_the_measured_throughputs(batches, data):
    """Each worker's measured throughput held (lines through the origin and its window), the
    equal-time plan's step time is what `balanced` compares the slowest measured time with."""
    times = data.draw(st.lists(st.floats(0.01, 10.0), min_size=len(batches), max_size=len(batches)))
    band = data.draw(st.floats(0.0, 0.5))
    total = sum(batches)
    lines = [(0.0, t / b) for b, t in zip(batches, times)]
    best = max(c * b for (_, c), b in zip(lines, equal_time(lines, total, 0, total)))
    assert min(times) <= best * (1 + 1e-9) and best <= max(times) * (1 + 1e-9)
    if max(times) <= (1 + band) * best * (1 - 1e-9):
        assert balanced(batches, times, band)
    if max(times) >= (1 + band) * best * (1 + 1e-9):
        assert not balanced(batches, times, band)


def test_decide_holds_a_plan_measured_balanced_whatever_the_lines_say():
    # the lines say worker 0 is 12 % slower (targets 30.2 / 33.8); its window measured 2 % slower
    lines = [(0.0, 1.12), (0.0, 1.0)]
    d = decide([32, 32], lines, 64, 1, 64, 0.05, measured=[1.02, 1.0])
    assert d.batches is None and d.held == (30, 34) and d.rule == "measured balanced within the deadband"
    assert decide([32, 32], lines, 64, 1, 64, 0.05).batches == (30, 34)  # the lines alone move it
    # measured 12 % slower, as the lines say: it moves; and with no deadband the measurement holds nothing
    assert decide([32, 32], lines, 64, 1, 64, 0.05, measured=[1.12, 1.0]).batches == (30, 34)
    assert decide([32, 32], lines, 64, 1, 64, 0.0, measured=[1.02, 1.0]).batches == (30, 34)


# -- the starting split ----------------------------------------------------------------

@FAST
@given(num_workers=st.integers(1, 16), extra=st.integers(0, 2000))
def test_uniform_start_is_equal(num_workers, extra):
    global_batch = num_workers + extra
    capacities = [float(i + 1) for i in range(num_workers)]  # ignored by uniform
    out = initial_batches("uniform", global_batch, capacities)
    assert all(type(x) is int for x in out)
    assert sum(out) == global_batch and min(out) >= 1
    assert max(out) - min(out) <= 1
    assert out == sorted(out, reverse=True)  # the extra samples go to the lowest ranks


@FAST
@given(capacities=st.lists(st.integers(1, 64), min_size=1, max_size=8), extra=st.integers(0, 2000))
def test_static_start_follows_capacity(capacities, extra):
    global_batch = len(capacities) + extra
    out = initial_batches("static", global_batch, capacities)
    assert sum(out) == global_batch and min(out) >= 1
    exact = water_fill([(0.0, 1.0 / w) for w in capacities], global_batch, 1, global_batch)
    assert np.all(np.abs(np.array(out) - exact) < 1), (out, exact)
    for i, ci in enumerate(capacities):
        for j, cj in enumerate(capacities):
            if ci > cj:
                assert out[i] >= out[j]
            if ci == cj:
                assert abs(out[i] - out[j]) <= 1


@FAST
@given(capacities=st.lists(st.integers(1, 64), min_size=1, max_size=8), lo=st.integers(1, 8),
       data=st.data())
def test_start_respects_the_bounds(capacities, lo, data):
    n = len(capacities)
    hi = data.draw(st.integers(lo, lo + 200))
    global_batch = data.draw(st.integers(lo * n, hi * n))
    for batching in ("uniform", "static", "dynamic"):
        out = initial_batches(batching, global_batch, capacities, lo, hi)
        assert sum(out) == global_batch
        assert all(lo <= b <= hi for b in out), (batching, out, lo, hi)


def test_start_examples():
    assert initial_batches("static", 64, [10, 20, 34]) == [10, 20, 34]
    assert initial_batches("dynamic", 64, [10, 20, 34]) == [10, 20, 34]
    assert initial_batches("uniform", 64, [10, 20, 34]) == [22, 21, 21]
    assert initial_batches("uniform", 64, [1, 3]) == [32, 32]
    assert initial_batches("static", 64, [1, 3]) == [16, 48]
    assert initial_batches("static", 4, [1, 1000, 1, 1]) == [1, 1, 1, 1]
    assert initial_batches("static", 64, [1, 1, 100], lo=1, hi=30) == [17, 17, 30]
    assert initial_batches("static", 12, [1, 100], lo=3) == [3, 9]


@pytest.mark.parametrize("capacities, want", [
    ([2.0**1023, 2.0**1023], [3, 2]),  # their sum overflows
    ([5e-324, 1.0], [1, 4]),  # 1 / 5e-324 overflows
    ([5e-324, 1e308], [1, 4]),  # the ratio underflows to 0
    ([2**64 - 1, 1], [4, 1]),
    ([1e-300, 3e-300], [1, 4]),
])
def test_extreme_capacities_split_the_batch(capacities, want):
    """Any finite capacity > 0 passes the wire's checks: each must give a plan, not an error."""
    assert initial_batches("static", 5, capacities) == want


@pytest.mark.parametrize("capacities", [[0, 1], [-1, 2], [1, float("nan")], [1, float("inf")], [0.0]])
def test_bad_capacities_are_refused(capacities):
    with pytest.raises(ValueError, match="capacities"):
        initial_batches("static", 10, capacities)


def test_start_refuses_impossible_bounds():
    with pytest.raises(ValueError):
        initial_batches("uniform", 10, [1, 1, 1], lo=4)
    with pytest.raises(ValueError):
        initial_batches("static", 10, [1, 1], lo=1, hi=4)


# -- plans on the wire ---------------------------------------------------------------

PLANS = st.builds(BatchPlan, gen=st.integers(0, 2**40),
                  batches=st.lists(st.integers(1, 10**6), min_size=1, max_size=8).map(tuple), stop=st.booleans())


def decoded(plan) -> BatchPlan:
    """`plan` (a header's map) as the codec takes it from a Plan message."""
    return codec.decode([msgpack.packb({"v": protocol.VERSION, "op": "plan", "plan": plan})]).plan


@FAST
@given(plan=PLANS)
def test_plan_round_trips_through_wire_form(plan):
    assert codec.decode(codec.encode(Plan(plan=plan))).plan == plan


def test_a_vacant_rank_has_batch_zero():
    assert decoded({"gen": 2, "batches": [0, 7]}).batches == (0, 7)


def test_stop_defaults_to_false():
    assert decoded({"gen": 3, "batches": [1, 2]}) == BatchPlan(3, (1, 2), False)


GOOD = {"gen": 1, "batches": [3, 5], "stop": False}


@pytest.mark.parametrize("bad", [
    None, [1, [3, 5]], "plan", 5,
    {**GOOD, "gen": -1}, {**GOOD, "gen": None}, {**GOOD, "gen": True}, {**GOOD, "gen": 1.0}, {**GOOD, "gen": "1"},
    {"batches": [3, 5]}, {**GOOD, "batches": []}, {**GOOD, "batches": [0, 0]},
    {**GOOD, "batches": [3, -5]}, {**GOOD, "batches": [3, 5.0]}, {**GOOD, "batches": [True, 5]},
    {**GOOD, "batches": None}, {**GOOD, "batches": [3, "5"]},
    {**GOOD, "stop": 1}, {**GOOD, "stop": "yes"}, {**GOOD, "stop": None},
])
def test_malformed_plans_are_refused(bad):
    with pytest.raises(ProtocolError, match="^bad_field: plan"):
        decoded(bad)


def test_a_plan_of_another_size_does_not_fit_the_job():
    assert BatchPlan(1, (3, 5)).sized(2) == BatchPlan(1, (3, 5))
    for batches in ((3,), (3, 5, 1)):
        with pytest.raises(ValueError, match=f"a plan's batches for {len(batches)} workers, the job has 2"):
            BatchPlan(1, batches).sized(2)


@settings(max_examples=60, deadline=None)
@given(d=st.dictionaries(st.sampled_from(["gen", "batches", "stop", "other"]),
                         st.one_of(st.none(), st.booleans(), st.integers(-3, 5), st.floats(allow_nan=False),
                                   st.text(max_size=2),
                                   st.lists(st.one_of(st.integers(-2, 5), st.booleans(), st.floats(0, 5)),
                                            max_size=3))))
def test_decoded_plans_fuzz(d):
    """Either a valid plan or ProtocolError, nothing else."""
    try:
        plan = decoded(d)
    except ProtocolError:
        return
    assert isinstance(plan.gen, int) and not isinstance(plan.gen, bool) and plan.gen >= 0
    assert plan.batches and all(type(b) is int and b >= 0 for b in plan.batches) and any(plan.batches)
    assert type(plan.stop) is bool


# -- the probe ------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds, flat", [
    ((0.010, 0.012), False),  # a fixed cost and a slope
    ((0.010, 0.020), False),  # all slope
    ((0.010, 0.0085), False),  # noise within PROBE_NOISE
    ((0.010, 0.007), True),  # the larger pass much faster: the smaller was slowed
    ((0.010, 0.030), False),  # more than the ratio of the sizes: a quota's periods, or the larger slowed
])
def test_a_probe_is_too_flat_only_where_its_larger_pass_is_faster(seconds, flat):
    assert probe_too_flat(seconds) is flat


def test_the_probe_takes_more_rounds_while_its_larger_pass_is_too_fast():
    slow = {2: [0.05] * 3 + [0.01] * 3, 4: [0.012] * 6}  # the 2-sample pass slowed 5x for 3 passes
    calls = []

    def timed(size):
        calls.append(size)
        return slow[size].pop(0)
    seconds, rounds, spread = probe_times(timed, (2, 4))
    assert seconds == [0.01, 0.012] and rounds == 2 * PROBE_ROUNDS and spread == 0  # the 4-sample passes agree
    assert calls == [2, 4] * rounds  # the sizes in turn


def test_the_probe_takes_a_pair_too_steep_for_a_line_as_it_is():
    """Passes a few quota periods long: the larger takes more than their ratio, the same every
    round (measured under cgroup quotas: 0.029 s and 0.080 s at 2 and 4 samples, 9 rounds running)."""
    calls = []

    def timed(size):
        calls.append(size)
        return {2: 0.029, 4: 0.080}[size]
    seconds, rounds, spread = probe_times(timed, (2, 4))
    assert seconds == [0.029, 0.080] and rounds == PROBE_ROUNDS and calls == [2, 4] * PROBE_ROUNDS and spread == 0


def test_the_probe_gives_up_after_its_retries():
    seconds, rounds, _ = probe_times(lambda size: 0.01 if size == 4 else 0.05, (2, 4))
    assert seconds == [0.05, 0.01] and rounds == PROBE_ROUNDS * (1 + PROBE_RETRIES)
    assert probe_times(lambda size: 0.001 * size, (2, 4)) == ([0.002, 0.004], PROBE_ROUNDS, 0.0)


def test_the_probes_spread_is_how_far_a_sizes_slowest_pass_ran_over_its_fastest_at_every_size():
    passes = {2: [0.030, 0.020], 4: [0.050, 0.060]}  # 50 % and 20 % apart: the spread is the lesser
    seconds, rounds, spread = probe_times(lambda size: passes[size].pop(0), (2, 4))
    assert seconds == [0.020, 0.050] and rounds == PROBE_ROUNDS and spread == pytest.approx(0.2)
    passes = {2: [0.090, 0.020], 4: [0.040, 0.040]}  # one slow pass: an outlier the fastest leaves out
    assert probe_times(lambda size: passes[size].pop(0), (2, 4)) == ([0.020, 0.040], PROBE_ROUNDS, 0.0)


def test_workers_are_alike_where_the_uniform_split_is_within_the_band_of_the_best_and_of_the_fastest():
    lines = [(0.0, 0.001), (0.0, 0.001), (0.0, 0.001 / 1.06), (0.0, 0.001 / 1.06)]
    best_s = 0.001 * 128 / (2 + 2 * 1.06)  # the equal-time plan's time
    assert alike(lines, [32] * 4, best_s, 0.05) == pytest.approx(0.032)
    assert alike(lines, [32] * 4, best_s, 0.02) is None  # 3 % slower than the best
    # one worker 4x faster than 63 others: the uniform split 5 % slower than the best, but not alike
    many = [(0.0, 0.001 / 4)] + [(0.0, 0.001)] * 63
    best_s = 0.001 * 32 * 64 / (63 + 4)
    assert 0.032 <= best_s * 1.05 and alike(many, [32] * 64, best_s, 0.05) is None
