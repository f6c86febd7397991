"""A worker's time model (omnips/timemodel.py): the line through its measured sizes, long
averages that follow a change or a drift, the points it keeps, and what it refuses."""

import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from omnips.batching import BatchPlan
from omnips import timemodel
from omnips.timemodel import DRIFT, REPEAT, TimeModels

from controller_helpers import SEARCH, TimeModel, control, run_window


def affine_model(a, c, b1, b2, affine=True):
    model = TimeModel(affine=affine)
    model.observe(b1, a + c * b1)
    model.observe(b2, a + c * b2)
    return model


LINES = st.tuples(st.floats(0.0, 50.0), st.floats(0.1, 5.0), st.integers(20, 300))


def near_pair(b1):
    """A second batch size spanning >= 10 % but < 20 % of the first."""
    return round(b1 * 1.15)


@settings(max_examples=40, deadline=None)
@given(line=LINES)
def test_two_sizes_give_the_exact_line(line):
    a, c, b1 = line
    model = affine_model(a, c, b1, near_pair(b1))
    fa, fc = model.line()
    assert fa == pytest.approx(a, rel=1e-9, abs=1e-9) and fc == pytest.approx(c, rel=1e-9)


def test_two_far_apart_sizes_give_the_exact_line():
    model = affine_model(50.0, 1.0, 32, 16)
    assert model.line() == pytest.approx((50.0, 1.0))


@settings(max_examples=40, deadline=None)
@given(line=LINES, factor=st.one_of(st.floats(0.25, 0.75), st.floats(1.3, 8.0)), at_old=st.booleans())
def test_speed_change_is_followed_after_one_window(line, factor, at_old):
    a, c, b1 = line
    b2 = near_pair(b1)
    model = affine_model(a, c, b1, b2)
    at = b1 if at_old else b2
    model.observe(at, factor * (a + c * at))
    for b in (1, b1, b2, 2 * b2, 1000):
        assert model.predict(b) == pytest.approx(factor * (a + c * b), rel=0.01)


def test_a_point_a_change_rescaled_is_a_guess_a_step_near_it_joins_the_fit():
    """Under a neighbour's CPU hog a worker's probe point at 4 samples, rescaled with the rest when
    the hog began, predicted 0.99 s there; its steps ran 0.62. Read as a change of speed, the whole
    history was rescaled by 0.63, and the plan gave it 17 samples, then 29 (1.5 and 2.7 s a step).
    The hog had not scaled its time alike at every batch: the step joins the fit, and the point at
    23, measured under the hog, stays."""
    model = affine_model(0.07, 0.03, 4, 23)
    assert model.trusted_at(4) and model.trusted_at(23)
    model.observe(23, 2.0 * (0.07 + 0.03 * 23))  # the hog: a change at 23, every point rescaled
    assert model.predict(4) == pytest.approx(2.0 * (0.07 + 0.03 * 4), rel=0.01)
    assert model.trusted_at(23) and not model.trusted_at(4)  # 4's point is the rescaled guess now
    model.observe(4, 0.62 * model.predict(4))
    assert model.predict(23) == pytest.approx(2.0 * (0.07 + 0.03 * 23), rel=0.01)  # not rescaled again
    assert model.trusted_at(4)  # measured at the speed now


def test_a_small_change_is_taken_as_noise_at_first():
    """Below 20 % (CHANGE) a new time is not a speed change: it is averaged into the point
    at its size (the earlier measurements there weigh REPEAT: the two averages part by less
    than DRIFT), the other points are not rescaled."""
    model = affine_model(20.0, 1.0, 60, 100)
    assert model.line() == pytest.approx((20.0, 1.0))
    model.observe(100, 1.1 * 120)
    assert model.predict(100) == pytest.approx((REPEAT * 120 + 132) / (REPEAT + 1))
    assert model.predict(60) == pytest.approx(80)  # the old speed


def test_fit_needs_two_sizes_spanning_ten_percent():
    # one point: the line through it and the origin
    model = TimeModel()
    model.observe(40, 60.0)
    assert model.line() == (0.0, 1.5)
    # the same size again: averaged with the earlier measurement there
    model.observe(40, 62.0)
    assert model.line() == pytest.approx((0.0, (REPEAT * 60.0 + 62.0) / (REPEAT + 1) / 40))
    # 100 and 91 span 9 %: still proportional, through the points' weighted mean (the older weighs FORGET)
    assert affine_model(5.0, 1.0, 100, 91).line() == pytest.approx((0.0, (0.5 * 105 + 96) / (0.5 * 100 + 91)))
    # 100 and 90 span 10 %: a fit
    assert affine_model(5.0, 1.0, 100, 90).line() == pytest.approx((5.0, 1.0))
    # the paper's rule never fits
    assert affine_model(5.0, 1.0, 100, 50, affine=False).line() == (0.0, 55.0 / 50)


def test_a_slope_needs_sizes_three_step_noises_apart():
    """With steps 5 % apart (their step noise), sizes must span 15 %: 100 and 90 give the newest
    window's throughput (the weighted mean of sizes that far apart is the fixed cost's), 100 and 80 a
    line; without a noise estimate 10 % is enough."""
    for low, noise, line in ((90, 0.0, (5.0, 1.0)), (80, 0.05, (5.0, 1.0)), (90, 0.05, (0.0, 95.0 / 90))):
        models = TimeModels(1)
        for b in (100, low):
            models.observe([0], [b], [5.0 + b], noise=[noise])
        assert tuple(models.lines([0])[0]) == pytest.approx(line)
    # the span is the worker's: a new one on the rank starts from MIN_SPREAD's
    models.reset([0])
    for b in (100, 90):
        models.observe([0], [b], [5.0 + b])
    assert tuple(models.lines([0])[0]) == pytest.approx((5.0, 1.0))


def test_a_steady_batch_keeps_its_fit_and_averages_its_noise():
    """Measurements at a size already held age only that point: a plan that stays put
    for many windows keeps the slope it learnt from the sizes before, and its point
    becomes an average over windows (noise shrinks) instead of the newest window."""
    model = affine_model(20.0, 1.0, 60, 100)
    rng = random.Random(1)
    times = [120 * (1 + rng.uniform(-0.03, 0.03)) for _ in range(20)]
    for t in times:
        model.observe(100, t)
    a, c = model.line()
    assert a > 0 and c == pytest.approx(1.0, rel=0.1)  # still affine: the point at 60 is kept
    assert abs(model.predict(100) - 120) < max(abs(t - 120) for t in times[-3:])


def test_a_point_measured_again_and_again_averages_many_windows():
    """The fit uses each point's long average (REPEAT a window): timing noise that flips from
    window to window shrinks three times further than in the short one (FORGET)."""
    model = affine_model(20.0, 1.0, 60, 100)
    for k in range(40):
        model.observe(100, 120 * (1.02 if k % 2 else 0.98))
    # the long average swings by 2 % * (1 - REPEAT) / (1 + REPEAT) = 0.22 %; the short one alone
    # by 2 % * (1 - FORGET) / (1 + FORGET) = 0.67 %
    assert abs(model.predict(100) / 120 - 1) < 0.0025
    points = model._models
    assert np.all(np.abs(points.steady - points.time) <= DRIFT * points.time)


def ramp_lag(per_window: float, windows: int) -> float:
    """How far one size's model trails a speed creeping up `per_window` (under CHANGE) after
    `windows` windows, relative to the time then."""
    model = TimeModel()
    model.observe(100, 120.0)
    for k in range(1, windows + 1):
        model.observe(100, 120 * (1 + per_window) ** k)
    return 1 - model.predict(100) / (120 * (1 + per_window) ** windows)


def test_a_drifting_speed_restarts_the_long_average(monkeypatch):
    """A speed creeping up 2 % a window: the long average would trail it by about REPEAT /
    (1 - REPEAT) windows' drift (8 %); parted from the short one by DRIFT two windows running,
    it restarts from it, with its weight, and keeps up within DRIFT and a window or two."""
    lag = ramp_lag(0.02, 30)
    assert 0 < lag < DRIFT + 0.02
    model = TimeModel()
    for k in range(30):
        model.observe(100, 120 * 1.02 ** k)
        points = model._models
        if points.steady[0, 0] == points.time[0, 0] and k > 1:  # restarted: the short one, its weight
            assert points.count[0, 0] == pytest.approx(points.weight[0, 0])
    monkeypatch.setattr(timemodel, "DRIFT", float("inf"))
    assert ramp_lag(0.02, 30) > 0.065  # the bound above is the restart's doing


def test_one_outlying_window_does_not_restart_the_long_average():
    """A window 15 % slow (under CHANGE), then the usual times: one gap beyond DRIFT is not a
    drift, so the long average takes the outlier at its weight (a fifth, once five windows
    are in it) rather than at the short one's (a half)."""
    model = affine_model(20.0, 1.0, 60, 100)
    for _ in range(20):
        model.observe(100, 120.0)
    errors = []
    for t in [138.0] + [120.0] * 10:
        model.observe(100, t)
        errors.append(model.predict(100) / 120 - 1)
    assert max(errors) == pytest.approx(0.15 * (1 - REPEAT), rel=0.01)
    assert all(later < earlier for earlier, later in zip(errors, errors[1:]))


def test_a_speed_change_restarts_the_long_average():
    """A change (beyond CHANGE) rescales the history by one window's ratio, noise and all:
    the long average restarts from the short one, with its weight, so that later windows
    wash that noise out sooner than from a long average's weight."""
    model = affine_model(20.0, 1.0, 60, 100)
    for _ in range(20):
        model.observe(100, 120.0)
    model.observe(100, 2 * 120 * 1.04)  # twice as slow, measured 4 % high
    points = model._models
    np.testing.assert_allclose(points.steady, points.time, rtol=1e-12)
    for _ in range(3):
        model.observe(100, 240.0)
    assert abs(model.predict(100) / 240 - 1) < 0.015


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.floats(100.0, 140.0), min_size=1, max_size=30))
def test_two_gaps_to_one_side_restart_the_long_average(times):
    """After every window the long average is within DRIFT of the short one, or parted from
    it for the first time to that side (a second gap to the same side restarts it)."""
    model = TimeModel()
    points = model._models
    for t in times:
        before = points.parted[0, 0]
        model.observe(100, t)
        gap = points.steady[0, 0] - points.time[0, 0]
        if abs(gap) > DRIFT * points.time[0, 0] * (1 + 1e-12):
            assert np.sign(gap) != before and points.parted[0, 0] == np.sign(gap)
        assert model.predict(100) == pytest.approx(points.steady[0, 0])


def test_gaps_to_alternate_sides_are_noise():
    """Windows 15 % slow and fast by turns part the two averages to either side in turn: no
    drift, so the long average holds near the mean where the short one swings."""
    model = TimeModel()
    for _ in range(10):
        model.observe(100, 120.0)
    for k in range(20):
        model.observe(100, 120 * (1.15 if k % 2 else 0.85))
        assert abs(model.predict(100) / 120 - 1) < 0.04
    assert abs(model._models.time[0, 0] / 120 - 1) > 0.04  # the short one, swinging


def test_a_size_the_plan_comes_back_to_takes_the_new_window_at_its_aged_weight():
    """New sizes age the other points' long averages as they age their weights: back at an
    old size after two others, a window 10 % slower (under CHANGE) moves the long average
    there by more than half of the way (its history kept a quarter of its weight), not by
    a fifth."""
    model = TimeModel()
    for _ in range(10):
        model.observe(100, 120.0)
    model.observe(200, 220.0)
    model.observe(300, 320.0)
    model.observe(100, 132.0)
    points = model._models
    at = np.flatnonzero(points.batch[:, 0] == 100)[0]
    assert points.steady[at, 0] > 126.0


def test_a_worker_holds_every_point_its_weights_keep():
    """A size measured again and again weighs up to 1 / (1 - FORGET): SLOTS leaves room for
    it and every lighter point above MIN_WEIGHT that new sizes keep aging."""
    models = TimeModels(1, affine=False)
    for b in (10, 20, 30, 40, 50, 60, 70):
        models.observe([0], [b], [0.01 * b])
    for b in (80, 90, 100, 110, 120, 130):
        for _ in range(8):
            models.observe([0], [b], [0.01 * b])
    models.observe([0], [140], [1.4])
    held = sorted(models.batch[models.weight[:, 0] > 0, 0].tolist())
    assert held == [80, 90, 100, 110, 120, 130, 140]


def test_with_every_slot_held_a_new_size_takes_the_lightest_points():
    """A plan that goes back to each old size keeps all of them heavy: a new size then takes
    the lightest point's slot, not the first one's."""
    models = TimeModels(1, affine=False)
    sizes = [100, 120, 140, 160, 180, 200, 220]
    for i, b in enumerate(sizes):
        models.observe([0], [b], [0.01 * b])
        for old in sizes[:i]:
            models.observe([0], [old], [0.01 * old])
    assert np.all(models.weight > 0)
    lightest = models.batch[np.argmin(models.weight[:, 0]), 0]
    models.observe([0], [240], [2.4])
    held = sorted(models.batch[:, 0].tolist())
    assert held == sorted(set(sizes + [240]) - {lightest}) and lightest != 100


def test_a_plan_moving_by_a_few_samples_keeps_its_fit_and_averages_its_noise():
    """A size within 5 % of a point of a fitted line is that point measured again, moved
    along the line: a plan that moves by a sample or two each window keeps the slope the far
    point gave, and the point near the plan averages the windows instead of the newest alone."""
    model = affine_model(20.0, 1.0, 60, 100)
    rng = random.Random(2)
    sizes = [98, 101, 99, 102, 97, 100, 103, 98, 101, 99] * 2
    errors = [rng.uniform(-0.03, 0.03) for _ in sizes]
    for b, e in zip(sizes, errors):
        model.observe(b, (20 + b) * (1 + e))
    assert np.count_nonzero(model._models.weight) == 2  # the far point and the one near the plan
    a, c = model.line()
    assert a > 0 and c == pytest.approx(1.0, rel=0.1)
    assert abs(model.predict(99) / 119 - 1) < max(abs(e) for e in errors[-3:])


def test_negative_intercept_and_slope_are_clamped():
    # t = -10 + 2b: the fitted intercept is negative -> a = 0, the line through the newest point
    model = affine_model(-10.0, 2.0, 20, 23)
    a, c = model.line()
    assert a == 0.0
    assert c == pytest.approx(36 / 23)
    # time falling with batch: no usable slope -> the proportional line through the newest point
    model = TimeModel()
    model.observe(20, 40.0)
    model.observe(23, 38.0)
    assert model.line() == (0.0, 38.0 / 23)


@SEARCH
@given(windows=st.lists(st.tuples(st.sampled_from([20, 23, 30, 40, 46, 60]), st.floats(0.8, 1.25)),
                        min_size=2, max_size=12))
def test_a_fitted_line_runs_through_the_newest_point(windows):
    """Windows at a few batches, each off a line by up to 25 %: wherever the other points lie,
    the model predicts the newest point's long average at its batch (the plan in force is
    judged by what it measured; the other points give the slope)."""
    model = TimeModel()
    m = model._models
    fitted = 0
    for b, noise in windows:
        model.observe(b, (0.1 + 0.03 * b) * noise)
        if timemodel._spread(m.weight, m.batch, m._span)[0]:
            newest = (m.weight[:, 0] > 0) & (m.batch[:, 0] == b)
            assert model.predict(b) == pytest.approx(float(m.steady[newest, 0][0]))
            fitted += 1
    assume(fitted)  # (windows at one batch give no fit: they say nothing here)


def test_a_point_left_by_the_plan_does_not_hold_the_plan_off_balance():
    """Under CPU quotas 12/12/8/16, worker 3 ran one window at 40 samples in 1.16 s, in a noise
    that passed, and then ran 46 samples in 1.43 s where the others ran theirs in 1.28-1.34.
    Its line bent through the old point (the weighted mean throughput through the origin)
    predicted it 6 % faster than it ran: the deadband held [30, 32, 20, 46], then [31, 32,
    20, 45] for good, 2.8 % slower than the quotas' plan, which the measured times call for."""
    ctl = control(num_workers=4, global_batch=128, adjust_every=10)
    ctl.probed({0: ([2, 4], [0.06643, 0.14239]), 1: ([2, 4], [0.09203, 0.20039]),
                2: ([2, 4], [0.10346, 0.27990]), 3: ([2, 4], [0.05147, 0.12509])}, {},
               {0: 0.038, 1: 0.178, 2: 0.060, 3: 0.341})
    # the windows measured, each plan set as the run's models set it
    for plan, times in [((37, 27, 20, 44), [1.470, 1.053, 1.439, 1.545]),
                        ((35, 34, 19, 40), [1.640, 1.571, 1.456, 1.163])]:
        ctl.plan = BatchPlan(ctl.plan.gen + 1, plan)
        run_window(ctl, times)
        ctl.replan()
    ctl.plan = BatchPlan(ctl.plan.gen + 1, (30, 32, 20, 46))
    per_sample = np.array([1.277 / 30, 1.343 / 32, 1.294 / 20, 1.431 / 46])  # from then on, steadily
    best = 128 / np.sum(1 / per_sample)  # the equal-time step, fractional samples allowed
    steps = []
    for _ in range(6):
        run_window(ctl, per_sample * ctl.plan.batches)
        ctl.replan()
        steps.append(float(np.max(per_sample * ctl.plan.batches)))
    assert max(steps[1:]) <= 1.015 * best, (ctl.plan.batches, steps, best)


@pytest.mark.parametrize("batch, seconds", [
    (0, 1.0), (-1, 1.0), (1, 0.0), (1, -1.0), (1, float("nan")), (1, float("inf")), (1, -float("inf")),
])
def test_bad_observations_are_refused(batch, seconds):
    model = TimeModel()
    model.observe(10, 20.0)
    with pytest.raises(ValueError):
        model.observe(batch, seconds)
    assert model.line() == (0.0, 2.0)  # untouched


def test_no_line_before_a_measurement():
    with pytest.raises(ValueError):
        TimeModel().line()
    with pytest.raises(ValueError):
        TimeModel().predict(4)


def test_workers_are_picked_by_index_or_by_mask_alike():
    models = TimeModels(4)
    models.observe([1, 2], [10, 20], [1.0, 2.0])
    mask = np.array([False, True, True, False])
    assert models.trusted_at([1, 2], [10, 30]).tolist() == [True, False]
    assert models.trusted_at(mask, [10, 30]).tolist() == [True, False]
    np.testing.assert_array_equal(models.lines(mask), models.lines([1, 2]))
    assert models.measured(mask).all() and not models.measured([0, 3]).any()


@pytest.mark.slow  # 40 searches, each feeding up to 5 workers many times
@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 5), affine=st.booleans())
def test_many_workers_model_as_each_alone(data, n, affine):
    """One model of n workers, fed any subset of them in any order (every worker in order is
    worked on in place), holds what n models of one worker fed the same hold."""
    many, alone = TimeModels(n, affine), [TimeModels(1, affine) for _ in range(n)]
    speed = data.draw(st.lists(st.floats(1e-3, 10.0), min_size=n, max_size=n))
    # a few sizes, some within 5 % of each other: points measured again, moved along the line,
    # parted averages and restarts, as well as new sizes and dropped points
    sizes = st.sampled_from([20, 21, 40, 42, 80, 84, 160, 200])
    for _ in range(20):
        ranks = data.draw(st.one_of(st.just(list(range(n))), st.permutations(range(n)).map(lambda p: p[:max(1, len(p) - 1)])))
        batches = data.draw(st.lists(sizes, min_size=len(ranks), max_size=len(ranks)))
        noise = data.draw(st.lists(st.floats(0.7, 1.3), min_size=len(ranks), max_size=len(ranks)))
        times = [speed[r] * (2 + b) * e for r, b, e in zip(ranks, batches, noise)]
        many.observe(ranks, batches, times)
        for r, b, t in zip(ranks, batches, times):
            alone[r].observe([0], [b], [t])
    for name in ("batch", "time", "weight", "steady", "count", "parted"):
        np.testing.assert_array_equal(getattr(many, name), np.hstack([getattr(m, name) for m in alone]), name)
    measured = np.flatnonzero(many.measured(np.arange(n)))
    # (the fit sums a worker's slots: numpy may order a column's sum differently from an array's)
    np.testing.assert_allclose(many.lines(measured), np.vstack([alone[r].lines([0]) for r in measured]), rtol=1e-12)
