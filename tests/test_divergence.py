"""The scheduler's divergence watch (scheduler/divergence.py) fed with crafted losses."""

import math

import pytest

from omnips.job import JobSpec
from omnips.scheduler.divergence import MARGIN, NONFINITE_RUN, RECOVERED, Diverged, LossWatch, Recovered

TRAIN = 100  # samples an epoch; reports of 10 samples


def feed(watch, losses):
    """Report `losses` (10 samples each); an evaluation after every epoch's worth of reports."""
    verdicts = []
    for k, loss in enumerate(losses, 1):
        verdicts.append(watch.on_loss(loss, 10, worker=k % 3, step=k // 3))
        if k % (TRAIN // 10) == 0:
            verdicts.append(watch.on_eval())
    return [v for v in verdicts if v is not None]


def test_a_learning_job_is_never_called_diverged():
    watch = LossWatch(JobSpec(mode="asp"), TRAIN)
    assert feed(watch, [2.3 * 0.97 ** k for k in range(60)]) == []
    assert watch.verdict is None and 2.0 < watch.first < 2.3


def test_a_loss_that_does_not_fall_below_the_first_epochs_for_two_evaluations_is_called_diverged_once():
    watch = LossWatch(JobSpec(mode="asp", async_correction="none"), TRAIN)
    # the second epoch learns a little, but stays within MARGIN of the start: stuck once
    assert feed(watch, [2.3] * 10 + [2.3 * (1 - MARGIN / 2)] * 10) == [] and watch._stuck == 1
    verdicts = feed(watch, [2.4] * 30)
    assert len(verdicts) == 1 and watch.verdict is verdicts[0]
    assert "has not fallen below its start (2.3)" in verdicts[0].reason
    assert "--async-correction dana" in verdicts[0].hint


def test_a_job_that_learns_between_two_stuck_evaluations_starts_the_count_again():
    watch = LossWatch(JobSpec(), TRAIN)
    assert feed(watch, [2.3] * 10 + [2.3] * 10 + [1.0] * 10 + [2.3] * 10) == []
    assert watch._stuck == 1
    verdict, = feed(watch, [2.3] * 10)
    assert verdict.hint == "try a lower --lr (now 0.05) or --momentum (now 0.9)"


def test_a_first_epoch_that_blew_up_does_not_hide_a_job_stuck_at_its_untrained_loss():
    watch = LossWatch(JobSpec(mode="asp", num_workers=8), TRAIN)
    # the untrained model's loss in the first reports, then a blow-up, then chance level for good
    assert feed(watch, [2.3] * 8 + [9.0] * 2 + [2.36] * 10) == []
    assert watch.first == pytest.approx(2.3)  # the first reports' mean, below the first epoch's (3.6)
    verdict, = feed(watch, [2.34] * 20)
    assert "has not fallen below its start (2.3)" in verdict.reason


def test_a_job_whose_untrained_loss_is_above_chance_level_is_stuck_once_it_sits_at_chance_level():
    chance = math.log(10)  # ten balanced classes
    # the untrained model's reports 3 % above chance level: sitting at chance level would be
    # within MARGIN of below its start, and never called stuck without the chance mark
    start = chance * 1.03
    watch = LossWatch(JobSpec(mode="asp", async_correction="none"), TRAIN, chance=chance)
    assert chance < start * (1 - MARGIN)
    verdict, = feed(watch, [start] * 10 + [chance] * 20)
    assert watch.first == pytest.approx(start)
    assert "has not fallen below chance level (2.303, the label frequencies' loss)" in verdict.reason
    # withdrawn once the loss falls RECOVERED below chance level, not its start
    assert feed(watch, [chance * (1 - RECOVERED) * 1.01] * 10) == [] and watch.verdict is verdict
    [recovered] = feed(watch, [chance * (1 - RECOVERED) * 0.99] * 10)
    assert isinstance(recovered, Recovered) and "now below chance level" in recovered.reason
    # a start below chance level stays the mark
    watch = LossWatch(JobSpec(mode="asp"), TRAIN, chance=chance)
    verdict, = feed(watch, [2.0] * 30)
    assert "has not fallen below its start (2)" in verdict.reason


def test_a_resumed_job_whose_loss_stays_where_the_checkpoint_left_it_is_not_diverged():
    watch = LossWatch(JobSpec(), TRAIN, resumed=True)
    assert feed(watch, [0.2] * 60) == [] and watch.verdict is None
    assert watch.on_loss(math.inf, 10, worker=0, step=3) is not None  # the non-finite rules still apply


def test_a_loss_that_is_not_finite_is_diverged_at_once():
    for loss in (math.nan, math.inf):
        watch = LossWatch(JobSpec(mode="bsp", optimizer="adam", momentum=0.0, lr=3.0, nan_policy="skip"), TRAIN)
        verdict = watch.on_loss(loss, 10, worker=2, step=7)
        assert verdict is not None and verdict.reason == f"worker 2's training loss at step 7 is not finite ({loss})"
        assert verdict.hint == "try a lower --lr (now 3)"
        assert watch.on_loss(math.nan, 10, worker=0, step=8) is None  # said once


def test_a_gradient_that_is_not_finite_is_diverged_where_it_ends_the_job_or_when_they_keep_coming():
    watch = LossWatch(JobSpec(nan_policy="fail"), TRAIN)
    verdict = watch.on_loss(2.0, 10, worker=1, step=3, finite_gradient=False)
    assert verdict is not None and verdict.reason == "worker 1's gradient at step 3 is not finite (loss 2)"
    # --nan-policy skip drops the odd one by design: only a run of them is a verdict
    watch = LossWatch(JobSpec(nan_policy="skip"), TRAIN)
    for _ in range(3):
        for step in range(NONFINITE_RUN - 1):
            assert watch.on_loss(2.0, 10, worker=0, step=step, finite_gradient=False) is None
        assert watch.on_loss(2.0, 10, worker=0, step=99) is None  # a finite one ends the run
    for step in range(NONFINITE_RUN - 1):
        assert watch.on_loss(2.0, 10, worker=0, step=step, finite_gradient=False) is None
    verdict = watch.on_loss(2.0, 10, worker=2, step=50, finite_gradient=False)
    assert verdict is not None and f"the {NONFINITE_RUN}th report running" in verdict.reason


def test_a_job_called_stuck_that_learns_after_all_is_said_to_have_recovered():
    watch = LossWatch(JobSpec(mode="asp"), TRAIN)
    # a model at chance level for its first epochs (a cnn on digits does this), then learning
    verdicts = feed(watch, [2.3] * 30)
    assert [type(v) for v in verdicts] == [Diverged] and watch.verdict is verdicts[0]
    assert feed(watch, [2.3 * (1 - RECOVERED / 2)] * 10) == [] and watch.verdict  # not far enough below its start
    [recovered] = feed(watch, [1.0] * 10)
    assert isinstance(recovered, Recovered) and "now below its start" in recovered.reason
    assert watch.verdict is None and feed(watch, [0.9 * 0.97 ** k for k in range(40)]) == []
    # it may be found stuck again, and then it is said again
    again = feed(watch, [2.3] * 30)
    assert [type(v) for v in again] == [Diverged]


def test_a_loss_that_is_not_finite_is_never_withdrawn():
    watch = LossWatch(JobSpec(mode="asp"), TRAIN)
    [verdict] = feed(watch, [2.3] * 10 + [float("nan")])
    assert feed(watch, [0.1] * 30) == [] and watch.verdict is verdict
