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

pytestmark = pytest.mark.cluster  # every test here starts processes

WHY = quota.available()


@pytest.mark.skipif(WHY is not None, reason=f"CPU quotas cannot be set here: {WHY}")
def test_a_worker_with_a_quarter_of_the_cpu_gets_the_smaller_batch(tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--model", "cnn", "--batching", "dynamic", "--global-batch", "64", "--max-steps", "40",
           "--adjust-every", "5", "--seed", "0"]
    with contextlib.ExitStack() as stack:
        fast, slow = (stack.enter_context(quota.CpuQuota(f"omnips-test-{os.getpid()}-{name}", cores))
                      for name, cores in (("fast", 0.6), ("slow", 0.15)))
        cluster = stack.enter_context(LocalCluster(run_dir, job, 1, [WorkerSpec(), WorkerSpec()]))
        cluster.start_scheduler()
        cluster.start_servers()
        for rank, group in ((0, fast), (1, slow)):  # each in its group from its start on
            group.add(cluster.procs[cluster.add_worker(WorkerSpec(), rank)].pid)
        run = finish(cluster)
        throttled = slow.throttled()
    s = run.summary
    assert s["status"] == "completed" and s["steps"] == 40, run.logs()
    assert throttled > 0  # the quota, not the model, made worker 1 slow
    b0, b1 = s["final_batches"]
    assert b0 > b1 and b0 + b1 == 64, s["final_batches"]
    # (the probe's passes of 2 and 4 samples fit inside one quota period: a step's time jumps
    # only where the quota runs out, so the windows, not the probe, find the slow worker)
