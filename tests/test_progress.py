"""The summary's figures from worker reports (scheduler/progress.py): what summary.json says."""

import pytest

from omnips.job import JobSpec
from omnips.protocol import Report
from omnips.scheduler.progress import Progress


def report(rank, step, batch, compute_s, network_s=0.0, wait_s=0.0, loss=1.0, staleness=0, overhead_s=0.0):
    return Report(rank=rank, step=step, batch=batch, compute_s=compute_s, network_s=network_s, wait_s=wait_s,
                  loss=loss, staleness=staleness, overhead_s=overhead_s)


def test_the_time_counts_from_the_earliest_probe_pass():
    p = Progress(JobSpec(mode="bsp", num_workers=2, global_batch=64, batching="dynamic"), 1438)
    p.on_probe(0.5, now=10.0)  # passes from 9.5 s
    p.on_probe(2.0, now=10.5)  # from 8.5 s: the slowest device's passes started first
    p.on_report(report(0, 0, 40, compute_s=1.0, network_s=0.25, wait_s=0.5, loss=2.0), now=12.0)
    p.on_report(report(1, 0, 24, compute_s=1.5, network_s=0.25, loss=3.0), now=12.5)
    s = p.summary()
    assert s["wall_s"] == 12.5 - 8.5 and s["samples_per_s"] == 64 / 4.0
    assert s["worker_wait_fraction"] == [0.75 / 4.0, 0.25 / 4.0]  # barrier and network, of the wall time
    assert s["final_train_loss"] == [2.0, 3.0] and s["worker_compute_s_per_step"] == [1.0, 1.5]


def test_without_a_probe_the_time_counts_from_the_first_steps_start():
    p = Progress(JobSpec(mode="bsp", num_workers=2, global_batch=64), 1438)
    # began at 18 s: compute, overhead (the network's 0.25 s among it) and the servers' hold
    p.on_report(report(0, 0, 32, compute_s=1.0, network_s=0.25, overhead_s=0.5, wait_s=0.5), now=20.0)
    p.on_report(report(1, 0, 32, compute_s=1.0), now=21.0)
    assert p.summary()["wall_s"] == 3.0


def test_the_time_counts_from_the_earliest_first_step_whichever_report_is_read_first():
    p = Progress(JobSpec(mode="bsp", num_workers=2, global_batch=64), 1438)
    p.on_report(report(1, 0, 24, compute_s=2.0), now=20.0)  # the slow worker: began at 18 s
    p.on_report(report(0, 0, 40, compute_s=1.0, wait_s=2.5), now=20.0)  # began at 16.5 s, then held
    p.on_report(report(1, 1, 24, compute_s=2.0), now=22.5)  # a later step moves nothing
    assert p.summary()["wall_s"] == 22.5 - 16.5


def test_staleness_is_averaged_over_the_updates():
    p = Progress(JobSpec(mode="asp", num_workers=2, epochs=4), 1438)
    for step, staleness in enumerate([0, 1, 5]):
        p.on_report(report(0, step, 16, compute_s=0.1, staleness=staleness), now=1.0 + step)
    p.on_report(report(1, 0, 16, compute_s=0.1, staleness=2), now=5.0)
    s = p.summary()
    assert s["steps"] == 4 and s["staleness_mean"] == pytest.approx(8 / 4) and s["staleness_max"] == 5


def test_a_report_sent_before_the_rewind_is_stale_until_the_worker_reports_from_where_it_was_sent():
    """A server's loss sends the workers back to a checkpoint; a report already on its way for a
    step past that one is dropped as stale, not refused (which would end the worker)."""
    p = Progress(JobSpec(mode="bsp", num_workers=2, global_batch=64), 1438)
    for rank in (0, 1):
        p.seat(rank, joined=False)
    for step in range(23):
        for rank in (0, 1):
            p.on_report(report(rank, step, 32, compute_s=0.1), now=float(step))
    p.resume([20, 20], [640, 640])
    late = report(1, 23, 32, compute_s=0.1)  # step 23, sent before worker 1 read the rewind
    assert p.stale(late) and not p.expects(late)
    assert not p.stale(report(1, 20, 32, compute_s=0.1))  # the step it was sent back to: expected
    p.on_report(report(1, 20, 32, compute_s=0.1), now=30.0)
    assert not p.stale(report(1, 23, 32, compute_s=0.1))  # it has read the rewind: now an error
    assert p.stale(report(0, 23, 32, compute_s=0.1))  # worker 0 has not reported since
