"""Processes that pause (a GC, a stalled VM, a closed laptop lid: here SIGSTOP) and wake.

Frozen for less than --dead-after, a process costs the job only the time it was frozen;
frozen for longer, it is taken for gone, and when it wakes it is told so and ends with the
reason, as is the scheduler, which the others gave up on."""

import signal
import time
from contextlib import contextmanager

import pytest
import torch

from omnips.launch import WorkerSpec
from omnips.metrics import read_events

from helpers import finish, single_process_model, start_cluster, wait_for_steps

FREEZE_S = 1.5  # the freeze itself: the process is stopped, nothing is waited for
LIVENESS = ["--heartbeat", "0.25", "--dead-after", "4"]


@contextmanager
def _stopped(proc):
    """proc frozen by SIGSTOP, and woken on the way out whatever happens, so that no
    stopped process outlives the test."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)  # a no-op once it has been reaped


def _step_events(run_dir) -> int:
    return sum(e["event"] == "step" for e in read_events(run_dir))


@pytest.mark.parametrize("victim", ["worker1", "server0", "scheduler"])
def test_a_process_frozen_for_less_than_dead_after_costs_the_job_nothing(tmp_path, victim):
    run_dir = tmp_path / "run"
    steps, batch = 160, 8
    job = ["--mode", "bsp", "--max-steps", str(steps), "--global-batch", str(batch), "--lr", "0.05", "--seed", "5",
           *LIVENESS]
    # the workers would give up on a server silent for 4 s: the frozen server is waited for, not given up on
    workers = [WorkerSpec(ms_per_step=25.0, extra=("--server-timeout", "4"))] * 2
    with start_cluster(run_dir, job, workers) as cluster:
        for _ in range(2):  # frozen twice, each time once the job has gone on 10 steps since the last wake
            wait_for_steps(run_dir, _step_events(run_dir) + 2 * 10)  # (a frozen scheduler reads the steps late)
            assert cluster.poll() is None
            with _stopped(cluster.procs[victim]):
                time.sleep(FREEZE_S)  # the freeze itself
        run = finish(cluster)  # every process exits 0
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 0 and s["workers_joined"] == 0, s
    assert s["server_restores"] == 0
    assert s["steps"] == steps and s["worker_steps"] == [steps, steps] and s["samples"] == steps * batch
    assert not [e for e in run.events if e["event"] == "membership" and e["change"] == "lost"]
    times = [e["t"] for e in run.events if e["event"] == "step"]
    assert sum(b - a >= 0.9 * FREEZE_S for a, b in zip(times, times[1:])) >= 2  # both freezes held the job
    assert " ERROR " not in run.logs() and " WARNING " not in run.logs(), run.logs()
    # and nothing was learned twice or lost: the model of the same steps in one process
    got, want = torch.load(run.dir / "model.pt"), single_process_model(steps=steps, global_batch=batch, lr=0.05,
                                                                        seed=5)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5)
