"""Dynamic batching on real compute under CPU quotas (benchmarks/quota.py), at a small size:
two workers running the cnn for real, one of them given a quarter of the other's CPU."""

import contextlib
import os
import sys
from pathlib import Path

import pytest

from omnips.launch import WorkerSpec

from helpers import finish, start_cluster, wait_for_event

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quota  # noqa: E402

WHY = quota.available()


@pytest.mark.skipif(WHY is not None, reason=f"CPU quotas cannot be set here: {WHY}")
def test_a_worker_with_a_quarter_of_the_cpu_gets_the_smaller_batch(tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--model", "cnn", "--batching", "dynamic", "--global-batch", "64", "--max-steps", "40",
           "--adjust-every", "5", "--seed", "0"]
    with contextlib.ExitStack() as stack:
        fast, slow = (stack.enter_context(quota.CpuQuota(f"omnips-test-{os.getpid()}-{name}", cores))
                      for name, cores in (("fast", 0.6), ("slow", 0.15)))
        cluster = stack.enter_context(start_cluster(run_dir, job, [WorkerSpec(), WorkerSpec()]))
        for rank, group in ((0, fast), (1, slow)):  # quotas from the registration on: torch imports at full speed
            wait_for_event(run_dir, lambda e, r=rank: e["event"] == "membership" and e.get("rank") == r
                           and e["role"] == "worker")
            group.add(cluster.procs[f"worker{rank}"].pid)
        run = finish(cluster)
        throttled = slow.throttled()
    s = run.summary
    assert s["status"] == "completed" and s["steps"] == 40, run.logs()
    assert throttled > 0  # the quota, not the model, made worker 1 slow
    b0, b1 = s["final_batches"]
    assert b0 > b1 and b0 + b1 == 64, s["final_batches"]
    # it took the worker's real speed in: more than the equal split, to the faster one
    assert any(e["event"] == "assign" and e["batches"][0] > 32 for e in run.events)
