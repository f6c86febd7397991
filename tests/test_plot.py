"""omnips/plot.py: what equal batches would have cost, estimated from a BSP run's step events."""

import pytest

from omnips.plot import uniform_estimate


def step(worker, number, batch, compute_s):
    return {"event": "step", "t": float(number), "worker": worker, "step": number, "batch": batch,
            "compute_s": compute_s}


def test_equal_batches_are_estimated_from_each_workers_throughput_at_its_batch():
    # worker 0 at 1 ms a sample with 30 samples, worker 1 at 3 ms a sample with 10: both 30 ms;
    # with 20 each, worker 0 would take 20 ms and worker 1 60 ms
    events = [step(0, 0, 30, 0.030), step(1, 0, 10, 0.030), step(0, 1, 30, 0.030)]  # step 1 lacks worker 1
    (row,) = uniform_estimate(events)
    assert row["step"] == 0 and row["ran_s"] == pytest.approx(0.030) and row["uniform_s"] == pytest.approx(0.060)
    assert row["ran_idle"] == {0: 0.0, 1: 0.0}
    assert row["uniform_idle"] == {0: pytest.approx(0.040), 1: pytest.approx(0.0)}


def test_steps_without_a_time_or_a_batch_are_left_out():
    events = [step(0, 0, 30, 0.030), step(1, 0, 0, 0.0), step(0, 1, 30, 0.03), step(1, 1, 10, 0.05)]
    rows = uniform_estimate(events)
    assert [r["step"] for r in rows] == [1] and rows[0]["ran_idle"][0] == pytest.approx(0.02)
