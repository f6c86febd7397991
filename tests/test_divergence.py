"""The scheduler's divergence watch (scheduler/divergence.py) fed with crafted losses."""

import math

from omnips.job import JobSpec
from scheduler.divergence import MARGIN, LossWatch

TRAIN = 100  # samples an epoch; reports of 10 samples


def feed(watch, losses, start_epoch=0.0):
    """Report `losses` (10 samples each) from `start_epoch` on; an evaluation after each epoch."""
    verdicts, samples = [], start_epoch * TRAIN
    for k, loss in enumerate(losses):
        verdicts.append(watch.on_loss(loss, 10, samples / TRAIN, worker=k % 3, step=k // 3))
        samples += 10
        if samples % TRAIN == 0:
            verdicts.append(watch.on_eval())
    return [v for v in verdicts if v is not None]


def test_a_learning_job_is_never_called_diverged():
    watch = LossWatch(JobSpec(mode="asp"))
    assert feed(watch, [2.3 * 0.97 ** k for k in range(60)]) == []
    assert watch.verdict is None and 2.0 < watch.first < 2.3


def test_a_loss_that_does_not_fall_below_the_first_epochs_for_two_evaluations_is_called_diverged_once():
    watch = LossWatch(JobSpec(mode="asp", async_correction="none"))
    first_epoch = [2.3] * 10
    # epoch 2 learns a little, but stays within MARGIN of the first epoch's mean: stuck once
    verdicts = feed(watch, first_epoch + [2.3 * (1 - MARGIN / 2)] * 10)
    assert verdicts == [] and watch._stuck == 1
    verdicts = feed(watch, [2.4] * 30, start_epoch=2)
    assert len(verdicts) == 1 and watch.verdict is verdicts[0]
    assert "has not fallen below its first epoch's (2.3)" in verdicts[0].reason
    assert "--async-correction momentum" in verdicts[0].hint


def test_a_job_that_learns_between_two_stuck_evaluations_starts_the_count_again():
    watch = LossWatch(JobSpec())
    assert feed(watch, [2.3] * 10 + [2.3] * 10 + [1.0] * 10 + [2.3] * 10) == []
    assert watch._stuck == 1
    verdict, = feed(watch, [2.3] * 10, start_epoch=4)
    assert verdict.hint == "try a lower --lr (now 0.05) or --momentum (now 0.9)"


def test_a_loss_or_gradient_that_is_not_finite_is_diverged_at_once():
    for loss, gradient in ((math.nan, True), (math.inf, True), (2.0, False)):
        watch = LossWatch(JobSpec(mode="bsp", optimizer="adam", momentum=0.0, lr=3.0))
        verdict = watch.on_loss(loss, 10, 0.0, worker=2, step=7, finite_gradient=gradient)
        assert verdict is not None and "worker 2's" in verdict.reason and "step 7 is not finite" in verdict.reason
        assert verdict.hint == "try a lower --lr (now 3)"
        assert watch.on_loss(math.nan, 10, 0.1, worker=0, step=8) is None  # said once
