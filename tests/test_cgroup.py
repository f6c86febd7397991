"""Dynamic batching on real compute under CPU quotas (benchmarks/quota.py), at a small size:
two workers running the cnn for real, one of them given a quarter of the other's CPU."""

import contextlib
import os
import sys
from pathlib import Path

import pytest

from omnips.launch import LocalCluster, WorkerSpec

from helpers import finish

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quota  # noqa: E402
from cgroup import Size, job_args  # noqa: E402
from upscaled import importable  # noqa: E402
from worse_windows import timeline  # noqa: E402

pytestmark = pytest.mark.cluster  # every test here starts processes

WHY = quota.available()


@pytest.mark.skipif(WHY is not None, reason=f"CPU quotas cannot be set here: {WHY}")
def test_a_worker_with_a_quarter_of_the_cpu_gets_the_smaller_batch(tmp_path):
    run_dir = tmp_path / "run"
    # the cgroup benchmark's job at a small size: the cnn's default channels, 64 samples a step
    job = job_args("affine", 40, 0, Size([16, 32], 64, 3)) + ["--adjust-every", "5"]
    with contextlib.ExitStack() as stack:
        fast, slow = (stack.enter_context(quota.CpuQuota(f"omnips-test-{os.getpid()}-{name}", cores))
                      for name, cores in (("fast", 0.6), ("slow", 0.15)))
        cluster = stack.enter_context(LocalCluster(run_dir, job, 1, [WorkerSpec(), WorkerSpec()], env=importable()))
        cluster.start_scheduler()
        cluster.start_servers()
        for rank, group in ((0, fast), (1, slow)):  # each in its group from its start on
            group.add(cluster.procs[cluster.add_worker(WorkerSpec(), rank)].pid)
        run = finish(cluster)
        throttled = slow.throttled()
    s = run.summary
    assert s["status"] == "completed" and s["steps"] == 40, run.logs()
    assert throttled > 0  # the quota, not the model, made worker 1 slow
    # each worker read its quota, and timed its probe at that quota's pace
    assert {e["worker"]: e["quota"] for e in run.events if e["event"] == "probe"} == {
        0: pytest.approx(0.6), 1: pytest.approx(0.15)}
    # the slow worker has the smaller batch in 3 steps of 4 at least (judged over the job: a window
    # under load can move the plan for a few steps before the plans' measured times move it back).
    # The digits are drawn 3x larger so that a step spans several quota periods, as in the cgroup
    # benchmark: at 8x8 a step took a few ms, under one period, and ran at once where the period's
    # quota was left or a period later where it ran out; a window's median then read the slow worker
    # as the faster one (2-20 ms at 23 samples), and 4 runs in 12 under load failed.
    batches = {(e["step"], e["worker"]): e["batch"] for e in run.events if e["event"] == "step"}
    steps = [k for k in range(40) if (k, 0) in batches and (k, 1) in batches]
    smaller = [k for k in steps if batches[k, 1] < batches[k, 0]]
    assert len(steps) == 40 and len(smaller) >= 0.75 * len(steps), sorted(batches.items())
    # what the benchmark compares with the uniform job's steps: each step, in order, on the host's clock
    ends = timeline(run.events, 2)
    assert [s for s, _, _ in ends] == steps and all(a[1] < b[1] for a, b in zip(ends, ends[1:]))
    assert [b for _, _, b in ends] == [(batches[k, 0], batches[k, 1]) for k in steps]


@pytest.mark.skipif(WHY is not None, reason=f"CPU quotas cannot be set here: {WHY}")
def test_a_share_under_a_tenth_of_a_core_lengthens_the_period():
    """The kernel takes no quota under 1 ms a period: a share of 4 % keeps its ratio in a longer
    period instead of being raised to 10 %, halving it lengthens the period again, and a tenth
    of a core or more keeps the 10 ms periods."""
    def share(q):
        if q.v2:
            quota_us, period_us = map(int, (q.path / "cpu.max").read_text().split())
        else:
            quota_us, period_us = (int((q.path / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        return quota_us, period_us

    with quota.CpuQuota(f"omnips-test-{os.getpid()}-small", 0.04) as q:
        assert share(q) == (1000, 25000)
        q.set(0.02)
        assert share(q) == (1000, 50000)
        q.set(0.25)
        assert share(q) == (2500, quota.PERIOD_US)
    assert not q.path.exists()
