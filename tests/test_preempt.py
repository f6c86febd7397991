"""Preemption with real processes: SIGUSR1 (or SIGTERM) to the scheduler, SIGTERM to a server
preempts the job (a checkpoint at the step the workers stop at, every process exits
PREEMPTED_EXIT) and `--resume auto` goes on from it; SIGTERM to a worker is a graceful leave."""

import re
import signal

import torch

from omnips.job import PREEMPTED_EXIT
from omnips.launch import WorkerSpec
from scheduler.checkpoints import resume_point

from helpers import Run, finish, start_cluster, wait_for_event, wait_for_steps

# no --checkpoint-every: the preemption writes the checkpoint it is resumed from
JOB = ["--mode", "bsp", "--max-steps", "60", "--global-batch", "64", "--lr", "0.05", "--seed", "4",
       "--heartbeat", "0.25", "--resume", "auto"]


def _codes(cluster) -> dict:
    return {name: proc.wait(timeout=60) for name, proc in cluster.procs.items()}


def test_sigusr1_preempts_and_the_same_command_resumes_to_a_bit_identical_model(tmp_path):
    run_dir = tmp_path / "run"
    reference = start_cluster(tmp_path / "reference", JOB, [WorkerSpec()] * 2, num_servers=2)
    slow = [WorkerSpec(ms_per_step=40.0)] * 2  # slow enough to be preempted mid-job
    with start_cluster(run_dir, JOB, slow, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 15)
        cluster.procs["scheduler"].send_signal(signal.SIGUSR1)
        codes = _codes(cluster)
        run = Run(cluster, codes["scheduler"])
    s = run.summary
    assert codes == {name: PREEMPTED_EXIT for name in codes}, (codes, run.logs())
    assert s["status"] == "preempted" and s["steps"] < 60
    assert s["preempted"] == f"SIGUSR1 at step {s['steps']}: model.pt written, checkpoint {s['steps']} complete"
    assert s["worker_steps"] == [s["steps"]] * 2 and resume_point(run_dir)[1].step == s["steps"]
    stopped_at = s["steps"]

    again = finish(start_cluster(run_dir, JOB, slow, num_servers=2))  # the same command
    s = again.summary
    assert s["status"] == "completed" and s["resumed_from_step"] == stopped_at and s["steps"] == 60
    want, got = torch.load(finish(reference).dir / "model.pt"), torch.load(run_dir / "model.pt")
    for k in want:
        assert torch.equal(want[k], got[k]), k  # as if never preempted, bit for bit


def test_sigterm_to_a_server_preempts_the_job(tmp_path):
    run_dir = tmp_path / "run"
    with start_cluster(run_dir, JOB, [WorkerSpec(ms_per_step=40.0)] * 2, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 10)
        cluster.procs["server1"].send_signal(signal.SIGTERM)
        codes = _codes(cluster)
        run = Run(cluster, codes["scheduler"])
    s = run.summary
    assert codes == {name: PREEMPTED_EXIT for name in codes}, (codes, run.logs())
    assert s["status"] == "preempted"
    log = (run_dir / "logs" / "server1.log").read_text()
    rank = re.search(r"server (\d+) on \S+: SIGTERM: asking the scheduler to preempt the job", log).group(1)
    assert s["preempted"].startswith(f"SIGTERM to server {rank} on ") and s["preempted"].endswith(
        f"at step {s['steps']}: model.pt written, checkpoint {s['steps']} complete"), s["preempted"]
    assert resume_point(run_dir)[1].step == s["steps"]


def test_sigterm_to_a_worker_is_a_graceful_leave_and_the_job_completes(tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--max-steps", "80", "--global-batch", "48", "--seed", "4", "--heartbeat", "0.25",
           "--dead-after", "60"]  # a leave is seen at once, never by the silence
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=30.0)] * 3) as cluster:
        wait_for_steps(run_dir, 3 * 10)
        cluster.procs["worker2"].send_signal(signal.SIGTERM)
        assert cluster.procs["worker2"].wait(timeout=30) == 0
        left = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["change"] == "left", 30)
        run = finish(cluster)
    s = run.summary
    assert s["status"] == "completed" and s["workers_left"] == 1 and s["workers_lost"] == 0
    assert left["rank"] == 2 and left["reason"].startswith("SIGTERM to worker 2 on "), left
    assert s["worker_steps"][:2] == [80, 80] and s["worker_steps"][2] == left["last_step"] + 1
    assert s["final_batches"][2] == 0 and sum(s["final_batches"]) == 48
    assert "leaving the job after step" in (run_dir / "logs" / "worker2.log").read_text()
