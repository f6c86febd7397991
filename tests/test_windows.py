"""A worker's window of measured steps (scheduler/windows.py), fed crafted steps as the cgroup
benchmark recorded them: what is an outlier, what a change of speed, and which steps measure it;
and whether a worker's first steps at a batch missed their guess (first_miss)."""

import numpy as np
import pytest

from omnips.scheduler.windows import CHANGE_STEPS, SMALL_CHANGE, Windows, first_miss


def test_a_far_step_is_an_outlier_and_change_steps_in_a_row_to_one_side_a_change():
    w = Windows(1)
    w.add(0, 16, 0.5)  # the first step at a size: warm-up, not measured
    for t in (0.100, 0.102, 0.098, 0.101):
        assert w.add(0, 16, t)
    assert not w.add(0, 16, 0.180) and w[0] == [0.100, 0.102, 0.098, 0.101]  # one: an outlier
    assert w.add(0, 16, 0.099)  # the next step back in line: the outlier is forgotten
    slow = [0.170 + 0.001 * k for k in range(CHANGE_STEPS)]
    assert not any(w.add(0, 16, t) for t in slow[:-1])
    assert w.add(0, 16, slow[-1]) and w[0] == slow  # CHANGE_STEPS in a row: the window restarts from them
    assert w.add(0, 16, 0.500) and w[0] == [0.500]  # past a factor FAR: at once (FAR_STEPS)


def test_two_steps_a_little_slow_are_outliers_and_a_third_makes_the_change():
    """Under CPU quotas at HL8 (benchmarks/cgroup.py) the fast worker's steps ran 1.02 and 1.03 s
    at its 0.72 s a step, then 0.72 again; taken as a change of speed, they re-planned 10 samples
    off it for the last steps. A change nearer than SMALL_CHANGE takes a step more; the hog's 2x
    still takes CHANGE_STEPS, and one past FAR (2x) FAR_STEPS."""
    steady = [0.72, 0.71, 0.73, 0.72, 0.70, 0.72]
    w = Windows(1)
    w.add(0, 90, 2.0)  # warm-up
    for t in steady:
        w.add(0, 90, t)
    assert not w.add(0, 90, 1.02) and not w.add(0, 90, 1.03) and 1.03 / 0.72 < SMALL_CHANGE
    assert w.add(0, 90, 0.72) and w[0] == steady + [0.72]  # outliers, both
    assert not w.add(0, 90, 1.02) and not w.add(0, 90, 1.03)
    assert w.add(0, 90, 1.01) and w[0] == [1.02, 1.03, 1.01]  # a third: a change
    assert not w.add(0, 90, 1.8) and w.add(0, 90, 1.75) and w[0] == [1.8, 1.75]  # 1.7x: CHANGE_STEPS
    assert w.add(0, 90, 3.6) and w[0] == [3.6]  # 2x: at once


def test_a_neighbour_s_hog_gone_is_a_change_at_the_first_step_and_its_window_takes_the_next():
    """Worker 0's steps at 12 samples under a neighbour's CPU hog (its quota shared), then the hog
    gone (the cgroup benchmark's neighbour case). Once counted in the spread at once, the first step
    after (0.57 s) widened the tolerance so far that the second (0.73 s, 0.47x the window's)
    fell inside it: the window took it, and the change waited 10 steps for a full window. The
    first, past FAR, is a change by itself now, and the second joins its window."""
    hog = [1.6, 2.22, 1.13, 1.49, 1.47, 1.87, 1.75, 1.11, 1.14, 1.52, 1.73, 1.72, 1.61, 2.24, 1.43, 1.1,
           1.48, 1.74, 0.97]
    w = Windows(1)
    w.add(0, 12, 3.0)  # the first step at a size: warm-up, not measured
    for t in hog[:-8]:
        w.add(0, 12, t)
    w.clear()  # a decision
    for t in hog[-8:]:
        w.add(0, 12, t)  # the window since
    assert w.add(0, 12, 0.57) and w[0] == [0.57]  # 2.7x off the window: a change at once
    assert w.add(0, 12, 0.73) and w[0] == [0.57, 0.73]


def test_a_change_s_window_leaves_out_a_step_that_ran_partly_at_the_old_speed():
    """A CPU quota halved mid-step: the worker's steps went 1.41 s, then 1.71 (partly at each
    speed), 2.70, 2.90. The change's window starts at 2.70: with 1.71 in it the model was rescaled
    by 1.56 where the speed moved by 2. A first step about as far off as the next stays in."""
    w = Windows(1)
    w.add(0, 67, 3.0)  # warm-up
    for t in (1.40, 1.42, 1.41, 1.43, 1.39, 1.41):
        w.add(0, 67, t)
    assert not w.add(0, 67, 1.71)
    assert w.add(0, 67, 2.70) and w[0] == [2.70]
    assert w.add(0, 67, 2.90) and w[0] == [2.70, 2.90]


def test_steps_past_far_in_a_row_are_a_change_where_the_tolerance_is_wider():
    """Worker 0 under the cgroup benchmark's neighbour: under the hog its steps at 7 samples took
    0.72 to 1.23 s, at 5 samples 0.40 to 1.28 s (a tolerance over 2x), then 0.55, 0.28, 0.30, 0.33 s
    once it was gone. No step was far off by that tolerance: the plan held until a full window, 11
    steps with the worker idle three quarters of each. Three steps in a row past FAR, to one side,
    are a change; such steps apart are outliers, left out of the window."""

    def hogged():  # as recorded, a decision after the steps at 7
        w = Windows(1)
        w.add(0, 7, 1.5)  # warm-up
        for t in (0.77, 1.23, 0.94, 0.91, 1.04, 0.72, 1.17, 0.96, 1.22):
            w.add(0, 7, t)
        w.clear()
        w.add(0, 5, 0.98)  # warm-up
        for t in (0.76, 0.4, 0.59, 0.66, 0.72, 1.28, 1.11, 1.02, 0.55):
            w.add(0, 5, t)
        assert w.noise.tolerance(0) > 1.0  # wider than FAR: no single step is far off
        return w, np.array([w.median[0]])

    w, median = hogged()
    assert not w.add(0, 5, 0.28) and not w.add(0, 5, 0.30) and not w.changed(0, median)
    assert w.add(0, 5, 0.33) and w[0] == [0.28, 0.30, 0.33] and w.changed(0, median)
    w, median = hogged()
    assert not w.add(0, 5, 0.28) and w.add(0, 5, 0.7) and not w.add(0, 5, 0.3)  # apart: outliers
    assert 0.28 not in w[0] and not w.changed(0, median)


def test_a_change_past_far_is_measured_by_its_steps_at_the_new_speed():
    """Worker 0 under the cgroup benchmark's neighbour: its steps at 23 samples ran 0.83 s, then
    the hog started within a step (1.56 s) and the next ran 2.49. A window of both rescaled its model
    by 2.4 where the hog's steps ran 3x, and the plan held 12 steps with it the slowest by 30 %. The
    hog gone, its steps at 5 samples went 0.52, 0.43, 0.24 s after about 0.7: a window of all three
    gave it 17 samples where its speed called for 23. A step about as far off as the furthest, within the
    worker's tolerance, is the new speed's noise and stays in."""
    w = Windows(1)
    w.add(0, 23, 2.0)  # warm-up
    for t in (0.83, 0.85, 0.81, 0.84, 0.82, 0.83):
        w.add(0, 23, t)
    assert not w.add(0, 23, 1.56)
    assert w.add(0, 23, 2.49) and w[0] == [2.49]  # a change past FAR: 1.56 ran partly at the old speed
    w.add(0, 5, 0.76)  # the hog's plan: warm-up, then its steps as recorded, a decision between
    for t in (0.78, 0.75, 0.72, 0.75, 0.9, 0.61, 0.79, 0.86, 0.76):
        w.add(0, 5, t)
    w.clear()
    for t in (0.63, 0.76, 0.68, 0.7, 0.77, 0.9):
        w.add(0, 5, t)
    assert not w.add(0, 5, 0.52) and not w.add(0, 5, 0.43)  # 1.45x off by their median: one more step
    assert w.add(0, 5, 0.24) and w[0] == [0.24]
    w.add(0, 8, 2.0)
    for t in (1.0, 1.02, 0.98, 1.01, 0.99, 1.0):
        w.add(0, 8, t)
    assert not w.add(0, 8, 1.9) and w.add(0, 8, 2.1) and w[0] == [1.9, 2.1]  # both at the new speed


def test_a_window_s_first_step_at_the_batch_it_had_is_judged_by_the_last_window():
    """Four equal workers under CPU quotas at HL1 (benchmarks/cgroup.py): a decision left the plan,
    and worker 2's next steps ran 1.06, 0.70 and 1.01 s at its 0.70 s a step. Taken as it was, the
    new window's first step made the one that followed look like the outlier, the window's median
    1.03, and the plan moved 8 samples for 12 steps. At a batch it had, the last window judges it;
    at a new batch with no model to guess its time, the first measured step is taken as it is."""
    w = Windows(1)
    w.add(0, 32, 2.3)  # warm-up
    for t in (0.70, 0.72, 0.69, 0.71, 0.70):
        w.add(0, 32, t)
    w.clear()  # a decision that left the batch
    assert not w.add(0, 32, 1.06)  # far off the last window: a suspect
    assert w.add(0, 32, 0.70) and not w.add(0, 32, 1.01) and w.add(0, 32, 0.71)
    assert w[0] == [0.70, 0.71] and w.median[0] == pytest.approx(0.705)
    w.clear()
    w.add(0, 24, 2.0)  # a new batch: warm-up, then its first measured step as it is
    assert w.add(0, 24, 0.80) and w[0] == [0.80]


def test_a_window_s_first_steps_at_a_new_batch_are_judged_by_the_model_s_prediction():
    """Under HL8 quotas (benchmarks/cgroup.py) worker 0 went to 14 samples, predicted 0.72 s, and
    its first measured steps there ran 1.16, 0.69, 0.98 and 0.72 s. Taken as it was, the first made
    0.69 the outlier, the window 1.16 and 0.98, and the plan moved 5 of its 14 samples off it for 4
    steps. Judged by the prediction, 1.16 is the suspect. Steps that all miss it to one side are
    still a change, at CHANGE_STEPS (the model was wrong: the window is theirs)."""
    w = Windows(1)
    w.add(0, 14, 2.0, predicted=0.72)  # warm-up
    assert not w.add(0, 14, 1.16, predicted=0.72)
    assert w.add(0, 14, 0.69, predicted=0.72) and not w.add(0, 14, 0.98, predicted=0.72)
    assert w.add(0, 14, 0.72, predicted=0.72) and w[0] == [0.69, 0.72]
    w.add(0, 20, 2.0, predicted=1.0)  # another batch, whose prediction the steps miss by 2x
    assert not w.add(0, 20, 2.0, predicted=1.0) and w.add(0, 20, 2.1, predicted=1.0) and w[0] == [2.0, 2.1]
    assert w.add(0, 20, 2.05, predicted=1.0) and not w.add(0, 20, 1.3, predicted=1.0)  # the window judges from then on


def test_a_window_restarted_at_a_change_is_the_change_whatever_the_model_says_of_its_count():
    """Worker 0 under the cgroup benchmark's neighbour, as recorded: steps of 1.1-1.28 s at 24
    samples, its model's 1.17, then the hog began within a step: 2.32 s, 2.02x the window (past FAR:
    a change at once, the window restarted from it) but 1.98x the model (two steps, were it counted
    again). The next two, at full hog, ran 3.15 and 3.04 s, 1.3x that partial step (three, a small
    change), and the change was seen at the fourth step: three of 3 s where the others took 1.2.
    The restart counted the change; far off the model too, it is the change at once."""
    model = np.array([1.17])
    w = Windows(1)
    w.add(0, 24, 3.0, predicted=1.17)  # warm-up
    for t in (1.15, 1.15, 1.12, 1.12, 1.18, 1.28, 1.19, 1.19, 1.2, 1.19, 1.21, 1.14, 1.11, 1.1, 1.12, 1.13):
        w.add(0, 24, t, predicted=1.17)
    assert not w.changed(0, model)
    assert w.add(0, 24, 2.32, predicted=1.17) and w[0] == [2.32]
    assert w.changed(0, model)
    w.clear()  # the decision: the window after it is counted afresh
    assert w.add(0, 24, 2.2, predicted=1.17) and w[0] == [2.2] and not w.changed(0, model)
    assert w.add(0, 24, 2.3, predicted=1.17) and w.changed(0, model)  # CHANGE_STEPS off the model, as ever
    w = Windows(1)  # a restart near the model, after steps off it: no change
    w.add(0, 24, 3.0, predicted=1.17)
    for t in (0.5, 0.52, 0.49, 0.51, 0.5):
        w.add(0, 24, t, predicted=1.17)
    assert w.add(0, 24, 1.18, predicted=1.17) and w[0] == [1.18] and not w.changed(0, model)


def test_first_steps_miss_their_guess_beyond_first_miss_all_to_one_side():
    assert first_miss([1.51, 1.6], 1.0) and first_miss([1.0, 0.9], 1.51) and first_miss([0.6, 0.5], 1.0)
    assert not first_miss([1.5, 1.6], 1.0) and not first_miss([1.0, 1.0], 1.5) and not first_miss([1.3, 2.0], 1.0)
    assert not first_miss([1.6, 0.6], 1.0)  # off both ways: noise
    assert not first_miss([1.6], 1.0) and not first_miss([1.6, 1.6], float("nan"))  # one step; no guess
    # three steps slower than FIRST_DRIFT (the first two may be within FIRST_MISS); faster: FIRST_MISS only
    assert first_miss([1.57, 1.35, 1.65], 1.0) and not first_miss([0.7, 0.75, 0.6], 1.0)
    assert not first_miss([1.57, 1.35], 1.0) and not first_miss([1.57, 1.25, 1.65], 1.0)
    assert not first_miss([1.4, 1.4, 0.7], 1.0)  # off both ways: noise
