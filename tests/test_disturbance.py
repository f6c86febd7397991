"""scheduler/disturbance.py: which reported steps overlapped an evaluation or a checkpoint write."""

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.scheduler.disturbance import HARMLESS, JUDGED, KEPT, MIN_JUDGED, SLACK_S, Disturbances, Effect


def test_a_step_overlaps_a_span_between_its_start_and_its_report():
    d = Disturbances()
    d.add(10.0, 10.5)
    assert not d.touches(9.9, 0.1)  # reported before the span began
    assert d.touches(10.2, 0.1)  # ran inside it
    assert d.touches(10.7, 0.3)  # started inside it (the span ended at 10.5)
    assert d.touches(10.5 + 0.3 + SLACK_S - 0.01, 0.3)  # started within SLACK_S of its end
    assert not d.touches(10.5 + 0.3 + SLACK_S + 0.01, 0.3)  # started after it, and the slack


def test_a_report_queued_during_a_span_counts_as_overlapping():
    d = Disturbances()
    d.add(5.0, 6.0)  # the scheduler evaluated from 5 to 6 s and read the queue at 6 s
    assert d.touches(6.001, 0.01)  # a step of 10 ms that finished at 5.2 s, read at 6.001 s


def test_only_the_newest_spans_are_kept():
    d = Disturbances()
    d.add(0.0, 1.0)
    for k in range(KEPT):
        d.add(100.0 + k, 100.5 + k)
    assert not d.touches(0.5, 0.1)


def test_disturbed_steps_are_measured_once_enough_of_them_ran_as_fast_as_their_windows():
    effect = Effect()
    for _ in range(MIN_JUDGED - 1):
        effect.note(0.97)
        assert not effect.harmless  # too few to say
    effect.note(1.0)
    assert effect.harmless and effect.judged == MIN_JUDGED
    for _ in range(JUDGED):  # evaluations that now slow the workers by a fifth
        effect.note(1.2)
    assert not effect.harmless and effect.median == 1.2


def test_between_harmless_and_twice_it_the_last_verdict_stands():
    """A median near the bound (a hog's noisy steps among them) does not turn measuring on and off."""
    slightly = 1 + 1.5 * HARMLESS
    on, off = Effect(), Effect()
    for ratio in [1.0] * MIN_JUDGED + [slightly] * JUDGED:
        on.note(ratio)
    for ratio in [1.5] * MIN_JUDGED + [slightly] * JUDGED:
        off.note(ratio)
    assert on.harmless and not off.harmless


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), max_size=3 * JUDGED))
def test_the_verdict_follows_the_median_of_the_newest_judged_steps(ratios):
    effect = Effect()
    for ratio in ratios:
        effect.note(ratio)
    newest = ratios[-JUDGED:]
    if len(newest) < MIN_JUDGED or statistics.median(newest) > 1 + 2 * HARMLESS:
        assert not effect.harmless
    elif statistics.median(newest) <= 1 + HARMLESS:
        assert effect.harmless
