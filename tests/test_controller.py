"""The scheduler's controller (scheduler/control.py) fed measured steps: when a window is
ready, what a decision moves, memory limits and bounds, and control at scale."""

import numpy as np
import pytest

from omnips.batching import BatchPlan
from omnips.scheduler.control import FIRST_WINDOW, Adjustment

from controller_helpers import control, exact_plan, run_window


def test_no_plan_goes_below_the_jobs_min_batch():
    # worker 2 is 20x slower: the equal-time plan gives it 1.46 of 60 samples
    lines = [(0.0, 0.001), (0.0, 0.001), (0.0, 0.020)]
    for lo, slowest in ((1, 1), (8, 8)):
        ctl = control(min_batch=lo)
        ctl.probed({r: ([2, 4], [2 * c, 4 * c]) for r, (_, c) in enumerate(lines)}, {})
        assert ctl.plan.batches[2] == slowest and sum(ctl.plan.batches) == 60, ctl.plan
        for _ in range(3):  # and windows measured there keep it so
            run_window(ctl, [a + c * b for (a, c), b in zip(lines, ctl.plan.batches)])
            ctl.replan()
            assert min(ctl.plan.batches) == ctl.plan.batches[2] == slowest and sum(ctl.plan.batches) == 60


def test_ready_needs_every_worker_to_have_a_full_window_after_its_first_measured_step():
    ctl = control(adjust_every=10)
    assert ctl.plan == BatchPlan(0, (20, 20, 20))
    assert not ctl.ready
    for rank in range(3):
        ctl.on_step(rank, 20, 1.0)  # the first step at a batch size: not measured
    for _ in range(FIRST_WINDOW - 1):
        for rank in range(3):
            ctl.on_step(rank, 20, 1.0)
    ctl.on_step(0, 20, 1.0)
    ctl.on_step(1, 20, 1.0)
    assert not ctl.ready  # worker 2 not measured enough yet
    ctl.on_step(2, 20, 1.0)
    assert ctl.ready  # never measured before: FIRST_WINDOW steps each decide the first plan
    assert ctl.replan().decision.batches is None  # equal speeds: the plan stays
    for _ in range(8):
        for rank in range(3):
            ctl.on_step(rank, 20, 1.0)
    assert not ctl.ready  # 8 of 9 measured steps
    ctl.on_step(0, 20, 1.0)
    ctl.on_step(1, 20, 1.0)
    assert not ctl.ready  # worker 2 still short
    ctl.on_step(2, 19, 1.0)  # a report at another batch size does not count
    ctl.on_step(2, 20, 0.0)  # nor a report without a time
    ctl.on_step(2, 20, -1.0)
    assert not ctl.ready
    ctl.on_step(2, 20, 1.0)
    assert ctl.ready


def test_first_step_and_stale_reports_are_not_measured():
    ctl = control(num_workers=2, global_batch=40, adjust_every=2)
    ctl.on_step(0, 20, 100.0)  # first step: warm-up
    ctl.on_step(0, 25, 7.0)  # not its batch
    ctl.on_step(0, 20, 2.0)
    ctl.on_step(1, 20, 100.0)
    ctl.on_step(1, 20, 2.0)
    assert ctl.ready
    adj = ctl.replan()
    assert isinstance(adj, Adjustment)
    assert adj.times == (2.0, 2.0) and adj.batches == (20, 20) and adj.reason == "window"
    assert adj.decision.batches is None  # balanced: inside the deadband
    assert ctl.plan == BatchPlan(0, (20, 20)) and ctl.adjustments == 0


def test_replan_moves_the_plan_and_the_generation_only_on_change():
    ctl = control()
    run_window(ctl, [1.0, 1.0, 1.0])
    adj = ctl.replan()
    assert adj.decision.batches is None and ctl.plan.gen == 0  # balanced
    assert not ctl.ready  # the windows start again
    run_window(ctl, [1.0, 1.0, 2.0], first=False)  # same batches: no warm-up step to drop
    assert ctl.ready
    adj = ctl.replan()
    assert adj.times == (1.0, 1.0, 2.0) and adj.batches == (20, 20, 20)
    assert sum(adj.decision.batches) == 60 and ctl.plan.batches == adj.decision.batches
    assert ctl.plan.gen == 1 and ctl.adjustments == 1
    assert ctl.plan.batches == (24, 24, 12)  # throughputs 20, 20, 10
    # a worker whose batch changed drops its first step at the new size again
    for rank, b in enumerate(ctl.plan.batches):
        for _ in range(ctl.job.adjust_every - 1):
            ctl.on_step(rank, b, 1.0)
    assert not ctl.ready
    for rank, b in enumerate(ctl.plan.batches):
        ctl.on_step(rank, b, 1.0)
    assert ctl.ready


@pytest.mark.parametrize("controller", ["affine", "proportional"])
def test_control_loop_converges_on_affine_workers(controller):
    """The job's --controller picks the time models: `affine` fits a + c*b and reaches the
    equal-time plan; `proportional` (the paper's rule) models each worker as its newest
    throughput, a line through the origin, and stops short of it, as the models alone do
    (test_affine_controller_reaches_the_equal_time_plan_where_the_proportional_one_stops_short),
    and then creeps on, one plan the deadband held back PERSIST decisions running at a time."""
    a, c, total = [40.0, 2.0, 2.0], [0.5, 1.0, 2.0], 96
    ctl = control(num_workers=3, global_batch=total, adjust_every=3, controller=controller)
    for _ in range(6):
        run_window(ctl, [ai + ci * b for ai, ci, b in zip(a, c, ctl.plan.batches)])
        assert ctl.ready
        ctl.replan()
        assert sum(ctl.plan.batches) == total
    lines = ctl.models.lines(np.arange(3))
    if controller == "affine":
        assert list(ctl.plan.batches) == exact_plan(a, c, total)
        np.testing.assert_allclose(lines, np.stack([a, c], axis=1))
    else:
        # (25, 47, 24) after two windows, then inside the deadband: 0.96 % slower than this one by
        # the true times, 1 % or more by the proportional models, which decide
        assert list(ctl.plan.batches) == [24, 48, 24]
        times = [ai + ci * b for ai, ci, b in zip(a, c, ctl.plan.batches)]
        np.testing.assert_allclose(lines, [[0.0, t / b] for t, b in zip(times, ctl.plan.batches)])
    assert ctl.adjustments == ctl.plan.gen == (2 if controller == "affine" else 3)


def test_limit_lowers_the_bound_and_replans_at_once():
    ctl = control(deadband=0.5)  # a wide deadband that a memory limit must ignore
    run_window(ctl, [1.0, 1.0, 1.0])
    # a limit above the current batch: the bound drops, the plan stays
    assert ctl.limit(0, 30) is None
    assert ctl.max_batch[0] == 30 and ctl.plan == BatchPlan(0, (20, 20, 20))
    # one sample too many (5 %, well inside the deadband): re-planned at once anyway
    adj = ctl.limit(0, 19)
    assert adj is not None and adj.reason == "memory"
    assert ctl.plan.batches[0] <= 19 and sum(ctl.plan.batches) == 60
    assert ctl.plan.gen == 1
    assert ctl.max_batch[0] == 19
    # a limit never raises the bound again
    assert ctl.limit(0, 50) is None and ctl.max_batch[0] == 19
    # the bound holds in later plans even when worker 0 is by far the fastest
    run_window(ctl, [0.1, 5.0, 5.0])
    ctl.replan()
    assert ctl.plan.batches[0] <= 19 and sum(ctl.plan.batches) == 60


def test_limit_before_any_measurement_keeps_the_others_balanced():
    ctl = control()
    adj = ctl.limit(0, 10)
    assert adj is not None
    assert ctl.plan == BatchPlan(1, (10, 25, 25))


def test_limit_refuses_when_the_workers_cannot_hold_the_global_batch():
    ctl = control(num_workers=2, global_batch=60)
    assert ctl.max_batch == [60, 60]
    ctl.limit(0, 1)  # 1 + 59 still holds 60
    assert ctl.plan.batches == (1, 59)
    with pytest.raises(ValueError):
        ctl.limit(1, 58)
    assert ctl.max_batch == [1, 60] and ctl.plan.batches == (1, 59)  # unchanged


def test_memory_estimate_bounds_the_plan_and_follows_the_worker():
    ctl = control(deadband=0.5)
    run_window(ctl, [1.0, 1.0, 1.0])
    assert ctl.estimate(0, 30) == (True, None)  # above the batch: bound only
    assert ctl.max_batch[0] == 30 and ctl.plan.batches == (20, 20, 20)
    applied, adj = ctl.estimate(0, 12)  # below it: re-planned at once, deadband or not
    assert applied and adj.reason == "memory" and ctl.plan.batches[0] <= 12 and sum(ctl.plan.batches) == 60
    # memory freed: the bound rises again (unlike an out-of-memory limit), the plan waits for a window
    assert ctl.estimate(0, 45) == (True, None) and ctl.max_batch[0] == 45
    run_window(ctl, [0.1, 5.0, 5.0])
    ctl.replan()
    assert 12 < ctl.plan.batches[0] <= 45


def test_memory_estimate_under_a_hard_limit_keeps_the_lower_one():
    ctl = control()
    ctl.limit(1, 15)
    assert ctl.estimate(1, 40) == (True, None)
    assert ctl.max_batch[1] == 15  # the out-of-memory limit still rules
    ctl.limit(1, 50)
    assert ctl.max_batch[1] == 15


def test_memory_estimate_that_cannot_hold_the_global_batch_is_not_applied():
    ctl = control(num_workers=2, global_batch=60)
    ctl.limit(0, 10)
    before = (ctl.plan, ctl.max_batch)
    assert ctl.estimate(1, 40) == (False, None)  # 10 + 40 < 60
    assert (ctl.plan, ctl.max_batch) == before


def test_max_batch_setting_bounds_the_plan():
    ctl = control(num_workers=2, global_batch=64, max_batch=40)
    assert ctl.max_batch == [40, 40]
    run_window(ctl, [0.1, 10.0])
    ctl.replan()
    assert ctl.plan.batches == (40, 24)
    with pytest.raises(ValueError):
        ctl.limit(1, 23)


def test_control_at_scale_reaches_the_best_integer_plan():
    """512 affine workers up to 8x apart, exact times: three adjustments reach a plan whose
    slowest worker is as fast as the best integer plan's, and it holds."""
    n = 512
    rng = np.random.default_rng(3)
    a = rng.uniform(1.0, 10.0, n)
    c = rng.uniform(0.1, 2.0, n) / rng.uniform(1.0, 8.0, n)
    total = 32 * n
    ctl = control(num_workers=n, global_batch=total, adjust_every=2)
    best = (a + c * np.array(exact_plan(a, c, total))).max()
    for _ in range(6):
        run_window(ctl, list(a + c * np.array(ctl.plan.batches)))
        assert ctl.ready
        ctl.replan()
        assert sum(ctl.plan.batches) == total and min(ctl.plan.batches) >= 1
    assert ctl.adjustments <= 3
    assert (a + c * np.array(ctl.plan.batches)).max() <= 1.01 * best


def test_a_plan_handed_in_drops_the_windows_it_moved():
    """The scheduler hands the controller every plan it sends: a worker whose batch the plan
    changed has its window (measured at the old size) dropped, the others keep theirs."""
    ctl = control(adjust_every=3)
    run_window(ctl, [1.0, 1.0, 1.0])
    assert ctl.ready
    ctl.plan = BatchPlan(1, (25, 20, 15))
    assert not ctl.ready
    for rank in (0, 2):
        for _ in range(3):  # the first step at the new size is not measured
            ctl.on_step(rank, ctl.plan.batches[rank], 1.0)
    assert ctl.ready  # worker 1 kept its full window
    adj = ctl.replan()
    assert adj.times == (1.0, 1.0, 1.0) and adj.batches == (25, 20, 15)
