"""SIGTERM to the scheduler (a preemption, a supervisor): the job stops, its model and a
checkpoint to resume from written first, and every process exits PREEMPTED_EXIT."""

import signal

import pytest
import torch

from omnips.job import PREEMPTED_EXIT
from omnips.launch import WorkerSpec
from omnips.scheduler.checkpoints import resume_point

from helpers import WAIT_FACTOR, Run, start_cluster, stopped, wait_for_steps

pytestmark = pytest.mark.cluster  # every test here starts processes


@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_sigterm_to_the_scheduler_writes_the_model_and_a_checkpoint_and_ends_the_job(tmp_path, mode):
    run_dir = tmp_path / "run"
    job = ["--mode", mode, "--max-steps", "20000", "--global-batch", "32", "--lr", "0.05", "--seed", "6",
           "--checkpoint-every", "25", "--heartbeat", "0.3"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 2, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 40)
        cluster.procs["scheduler"].send_signal(signal.SIGTERM)
        codes = {name: proc.wait(timeout=60 * WAIT_FACTOR) for name, proc in cluster.procs.items()}  # each by itself
        run = Run(cluster, codes["scheduler"])
    s = run.summary
    assert codes == {name: PREEMPTED_EXIT for name in codes}, (codes, run.logs())
    assert s["status"] == "preempted" and s["stopped"] == (f"SIGTERM at step {s['steps']}: model.pt written, "
                                                            f"checkpoint {s['steps']} complete"), s
    if mode == "bsp":  # all at one step
        assert s["worker_steps"] == [s["steps"]] * 2
    assert s["final_test_accuracy"] is not None
    state = torch.load(run_dir / "model.pt")
    assert state and all(torch.isfinite(v).all() for v in state.values())
    # the model is the one the workers stopped at, read after every step had ended
    events = run.events
    last_step = max(i for i, e in enumerate(events) if e["event"] == "step")
    final = [i for i, e in enumerate(events) if e["event"] == "eval" and e["final"]]
    assert len(final) == 1 and final[0] > last_step
    if mode == "bsp":
        assert events[final[0]]["versions"] == [s["steps"]] * 2
    # and a resume goes on from where it stopped
    assert resume_point(run_dir)[1].step == s["steps"]


def test_sigterm_with_a_worker_frozen_still_writes_the_model_at_the_step_the_others_wait_at(tmp_path):
    # worker 1 is frozen (a worker that died, --dead-after not yet passed), perhaps part-way through
    # its push: worker 0 waits at the BSP barrier. The stop takes worker 1 for lost after a few
    # silent seconds, every shard ends worker 0's step, and the model is read at that version
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--max-steps", "20000", "--global-batch", "32", "--seed", "6", "--checkpoint-every", "25",
           "--heartbeat", "0.3", "--dead-after", "60"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 2, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 30)
        with stopped(cluster.procs["worker1"]):
            cluster.procs["scheduler"].send_signal(signal.SIGTERM)
            code = cluster.procs["scheduler"].wait(timeout=60 * WAIT_FACTOR)
        codes = {name: proc.wait(timeout=60 * WAIT_FACTOR) for name, proc in cluster.procs.items()}
        run = Run(cluster, code)
    s = run.summary
    assert s["status"] == "preempted" and s["stopped"] == (f"SIGTERM at step {s['steps']}: model.pt written, "
                                                            f"checkpoint {s['steps']} complete"), (s, run.logs())
    assert code == PREEMPTED_EXIT and all(c in (0, 1, PREEMPTED_EXIT) for c in codes.values()), codes
    [lost] = [e for e in run.events if e["event"] == "membership" and e["change"] == "lost"]
    assert lost["rank"] == 1 and " during the stop" in lost["reason"], lost
    final = [e for e in run.events if e["event"] == "eval" and e["final"]]
    assert len(final) == 1 and final[0]["versions"] == [s["steps"]] * 2  # every shard at the barrier's version
    assert torch.load(run_dir / "model.pt")
    assert resume_point(run_dir)[1].step == s["steps"]
