"""Preemption with real processes: SIGUSR1 (or SIGTERM) to the scheduler, SIGTERM to a server
preempts the job (a checkpoint at the step the workers stop at, every process exits
PREEMPTED_EXIT) and `--resume auto` goes on from it; SIGTERM to a worker is a graceful leave."""

import re
import signal

import pytest
import torch

from omnips.job import PREEMPTED_EXIT
from omnips.launch import LocalCluster, WorkerSpec
from omnips.scheduler.checkpoints import resume_point
from omnips.scheduler.stopping import on_leave

from helpers import WAIT_FACTOR, Run, finish, wait_for_event, wait_for_steps

START_S = 150  # for the cluster to start and train a few steps: imports take long on a loaded host
# no --checkpoint-every: the preemption writes the checkpoint it is resumed from
JOB = ["--mode", "bsp", "--max-steps", "60", "--global-batch", "64", "--lr", "0.05", "--seed", "4",
       "--heartbeat", "0.25", "--resume", "auto"]


def test_a_leave_preempts_for_a_server_or_the_last_worker_and_is_a_departure_for_another_worker():
    assert [on_leave("server", stopping, 2) for stopping in (False, True)] == ["preempt"] * 2
    assert [on_leave("worker", stopping, 0) for stopping in (False, True)] == ["preempt"] * 2
    assert on_leave("worker", False, 1) == "depart" and on_leave("worker", True, 1) == "stopped"


def start_cluster(run_dir, job, workers, num_servers=1) -> LocalCluster:
    return LocalCluster(run_dir, list(job), num_servers, list(workers)).start(START_S)


def _codes(cluster) -> dict:
    return {name: proc.wait(timeout=60 * WAIT_FACTOR) for name, proc in cluster.procs.items()}


@pytest.mark.cluster
def test_sigusr1_preempts_and_the_same_command_resumes_to_a_bit_identical_model(tmp_path):
    run_dir = tmp_path / "run"
    reference = start_cluster(tmp_path / "reference", JOB, [WorkerSpec()] * 2, num_servers=2)
    slow = [WorkerSpec(ms_per_step=40.0)] * 2  # slow enough to be preempted mid-job
    with start_cluster(run_dir, JOB, slow, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 15, START_S)
        cluster.procs["scheduler"].send_signal(signal.SIGUSR1)
        codes = _codes(cluster)
        run = Run(cluster, codes["scheduler"])
    s = run.summary
    assert codes == {name: PREEMPTED_EXIT for name in codes}, (codes, run.logs())
    assert s["status"] == "preempted" and s["steps"] < 60
    assert s["stopped"] == f"SIGUSR1 at step {s['steps']}: model.pt written, checkpoint {s['steps']} complete"
    assert s["worker_steps"] == [s["steps"]] * 2 and resume_point(run_dir)[1].step == s["steps"]
    stopped_at = s["steps"]

    again = finish(start_cluster(run_dir, JOB, slow, num_servers=2))  # the same command
    s = again.summary
    assert s["status"] == "completed" and s["resumed_from_step"] == stopped_at and s["steps"] == 60
    want, got = torch.load(finish(reference).dir / "model.pt"), torch.load(run_dir / "model.pt")
    for k in want:
        assert torch.equal(want[k], got[k]), k  # as if never preempted, bit for bit


@pytest.mark.cluster
def test_sigterm_to_a_server_preempts_the_job(tmp_path):
    run_dir = tmp_path / "run"
    with start_cluster(run_dir, JOB, [WorkerSpec(ms_per_step=40.0)] * 2, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 10, START_S)
        cluster.procs["server1"].send_signal(signal.SIGTERM)
        codes = _codes(cluster)
        run = Run(cluster, codes["scheduler"])
    s = run.summary
    assert codes == {name: PREEMPTED_EXIT for name in codes}, (codes, run.logs())
    assert s["status"] == "preempted"
    log = (run_dir / "logs" / "server1.log").read_text()
    rank = re.search(r"server (\d+) on \S+: SIGTERM: asking the scheduler to preempt the job", log).group(1)
    assert s["stopped"].startswith(f"SIGTERM to server {rank} on ") and s["stopped"].endswith(
        f"at step {s['steps']}: model.pt written, checkpoint {s['steps']} complete"), s["stopped"]
    assert resume_point(run_dir)[1].step == s["steps"]


@pytest.mark.cluster
def test_sigterm_to_a_worker_is_a_graceful_leave_and_the_job_completes(tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--max-steps", "80", "--global-batch", "48", "--seed", "4", "--heartbeat", "0.25",
           "--dead-after", "60"]  # a leave is seen at once, never by the silence
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=30.0)] * 3) as cluster:
        wait_for_steps(run_dir, 3 * 10, START_S)
        cluster.procs["worker2"].send_signal(signal.SIGTERM)
        assert cluster.procs["worker2"].wait(timeout=30 * WAIT_FACTOR) == 0
        left = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["change"] == "left", 30)
        run = finish(cluster)
    s = run.summary
    assert s["status"] == "completed" and s["workers_left"] == 1 and s["workers_lost"] == 0
    assert left["rank"] == 2 and left["reason"].startswith("SIGTERM to worker 2 on "), left
    assert s["worker_steps"][:2] == [80, 80] and s["worker_steps"][2] == left["last_step"] + 1
    assert s["final_batches"][2] == 0 and sum(s["final_batches"]) == 48
    assert "leaving the job after step" in (run_dir / "logs" / "worker2.log").read_text()


@pytest.mark.cluster
def test_sigterm_to_every_process_at_once_preempts_the_job_and_leaves_it_resumable(tmp_path):
    # a batch system's cancellation or a node drain signals every process, workers first here
    run_dir = tmp_path / "run"
    with start_cluster(run_dir, JOB, [WorkerSpec(ms_per_step=40.0)] * 2, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 10, START_S)
        for proc in reversed(list(cluster.procs.values())):
            proc.send_signal(signal.SIGTERM)
        codes = _codes(cluster)
        run = Run(cluster, codes["scheduler"])
    s = run.summary
    assert codes["scheduler"] == PREEMPTED_EXIT and set(codes.values()) <= {0, PREEMPTED_EXIT}, (codes, run.logs())
    assert s["status"] == "preempted" and s["stopped"].endswith(f"checkpoint {s['steps']} complete"), s
    assert resume_point(run_dir)[1].step == s["steps"]
