"""scheduler/disturbance.py: which reported steps overlapped an evaluation or a checkpoint write."""

from omnips.scheduler.disturbance import KEPT, SLACK_S, Disturbances


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
