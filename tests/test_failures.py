"""Nothing waits forever: a dead scheduler or server, or a NaN gradient, ends the job with a clear reason."""

import json
import math
import re
import signal
from contextlib import contextmanager

import pytest
import torch

from omnips.launch import LocalCluster, WorkerSpec

from helpers import (JOB_TIMEOUT_S, WAIT_FACTOR, assert_trained_as_one_process, error_lines, finish, poll_until,
                     start_cluster, stopped, wait_for_event, wait_for_steps)

pytestmark = pytest.mark.cluster  # every test here starts processes

SLOW = ["--max-steps", "100000", "--global-batch", "8"]


@contextmanager
def _running(tmp_path, flags, worker_flags=()):
    """(run directory, cluster) of an endless job of two workers at 50 ms a step and a
    server, once it has run 4 steps."""
    run_dir = tmp_path / "run"
    workers = [WorkerSpec(ms_per_step=50.0, extra=tuple(worker_flags))] * 2
    with start_cluster(run_dir, [*SLOW, *flags], workers) as cluster:
        wait_for_steps(run_dir, 2 * 4)
        yield run_dir, cluster


def test_dead_scheduler_ends_servers_and_workers(tmp_path):
    with _running(tmp_path, ["--dead-after", "3", "--heartbeat", "0.5"]) as (run_dir, cluster):
        cluster.procs["scheduler"].send_signal(signal.SIGKILL)
        others = {n: p for n, p in cluster.procs.items() if n != "scheduler"}
        codes = {n: p.wait(timeout=30 * WAIT_FACTOR) for n, p in others.items()}
    assert all(code == 1 for code in codes.values()), codes
    for name in others:
        assert "no word from the scheduler" in (run_dir / "logs" / f"{name}.log").read_text(), name


def test_a_dead_server_without_a_checkpoint_fails_the_job_with_the_reason(tmp_path):
    job = ["--stall-timeout", "60", "--heartbeat", "0.5", "--dead-after", "3"]
    with _running(tmp_path, job, ["--server-timeout", "20"]) as (run_dir, cluster):
        cluster.procs["server0"].send_signal(signal.SIGKILL)
        code = cluster.procs["scheduler"].wait(timeout=JOB_TIMEOUT_S)
        worker_codes = [cluster.procs[f"worker{i}"].wait(timeout=30 * WAIT_FACTOR) for i in range(2)]
    assert code == 1 and worker_codes == [1, 1]
    summary = json.loads((run_dir / "summary.json").read_text())
    # found by its silence (not by the 60 s stall timeout)
    assert summary["status"].startswith("failed: server 0 at tcp://") and "silent" in summary["status"]
    assert "server 0" in (run_dir / "logs" / "worker0.log").read_text()


def test_a_job_without_progress_for_the_stall_timeout_fails_with_the_reason(tmp_path):
    # the frozen server's silence would be found after 60 s, and the workers wait 120 s for its answer:
    # only the stall timeout can end this job soon
    with _running(tmp_path, ["--stall-timeout", "3", "--heartbeat", "0.5", "--dead-after", "60"]) as (run_dir, cluster):
        with stopped(cluster.procs["server0"]):
            code = cluster.procs["scheduler"].wait(timeout=30 * WAIT_FACTOR)
            worker_codes = [cluster.procs[f"worker{i}"].wait(timeout=30 * WAIT_FACTOR) for i in range(2)]
        server_code = cluster.procs["server0"].wait(timeout=30 * WAIT_FACTOR)  # woken: it reads the failure and ends
    assert code == 1 and worker_codes == [1, 1] and server_code == 1, (code, worker_codes, server_code)
    status = "failed: no progress reported for 3 s"  # the stall timeout ended it, not the 60 s ones
    assert json.loads((run_dir / "summary.json").read_text())["status"] == status
    for name in ("worker0", "worker1", "server0"):
        assert f"scheduler ended the job: {status}" in (run_dir / "logs" / f"{name}.log").read_text(), name


def test_a_server_that_does_not_answer_ends_the_worker_after_its_server_timeout(tmp_path):
    # the scheduler would take the frozen server for dead after 60 s, and fail the stalled job after 60 s
    job = ["--stall-timeout", "60", "--heartbeat", "0.5", "--dead-after", "60"]
    with _running(tmp_path, job, ["--server-timeout", "3"]) as (run_dir, cluster):
        with stopped(cluster.procs["server0"]):
            codes = [cluster.procs[f"worker{i}"].wait(timeout=30 * WAIT_FACTOR) for i in range(2)]
            scheduler_code = cluster.procs["scheduler"].wait(timeout=30 * WAIT_FACTOR)  # each worker told it why it left
    assert codes == [1, 1] and scheduler_code == 1, (codes, scheduler_code)  # the workers' own timeout
    status = json.loads((run_dir / "summary.json").read_text())["status"]
    assert re.fullmatch(r"failed: every worker is gone \(the last, worker \d: failed: worker \d on \S+: no answer "
                        r"from server 0 at \S+ within 3 s\)", status), status
    for i in range(2):
        log = (run_dir / "logs" / f"worker{i}.log").read_text()
        endpoint = re.search(r"server 0: connecting to (\S+)", log).group(1)  # tcp, or its unix socket
        assert f"ERROR no answer from server 0 at {endpoint} within 3 s" in log, log[-2000:]


def test_a_server_and_a_worker_never_welcomed_give_up_after_their_welcome_timeout(tmp_path):
    run_dir = tmp_path / "run"
    worker = WorkerSpec(extra=("--welcome-timeout", "3"))
    # the job needs two servers and one is started: the scheduler acknowledges the server and the
    # worker and never welcomes them
    with LocalCluster(run_dir, [*SLOW, "--register-timeout", "60"], 2, [worker],
                      server_args=["--welcome-timeout", "3"]) as cluster:
        cluster.start_scheduler()
        cluster.start_server("server0")
        cluster.add_worker(worker, 0)
        poll_until(lambda: (run_dir / "logs" / "scheduler.log").read_text().count("registered from") == 2 or None,
                   60, "the server and the worker registered")
        codes = {name: cluster.procs[name].wait(timeout=30 * WAIT_FACTOR) for name in ("server0", "worker0")}
        assert cluster.poll() is None  # the scheduler still waits for its cluster: the two gave up on their own
    assert codes == {"server0": 1, "worker0": 1}
    reason = (f"scheduler at {cluster.endpoint} did not complete the cluster (are all servers and workers "
              "started?) within 3 s")
    for name in codes:
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert error_lines(log) == [reason], log[-2000:]
        assert "Traceback" not in log


def test_nan_policy_skip_drops_the_gradient_and_trains_on(run_job):
    workers = [WorkerSpec(), WorkerSpec(extra=("--fault-nan-at", "3,7"))]
    run = run_job(["--mode", "bsp", "--max-steps", "30", "--global-batch", "32", "--nan-policy", "skip"], workers)
    s = run.summary
    assert s["status"] == "completed" and s["worker_steps"] == [30, 30] and s["nonfinite_gradients"] == 2
    nan = [(e["worker"], e["step"], e["policy"]) for e in run.events if e["event"] == "nonfinite"]
    assert nan == [(1, 3, "skip"), (1, 7, "skip")]
    state = torch.load(run.dir / "model.pt")
    assert all(torch.isfinite(v).all() for v in state.values())
    assert "dropped (--nan-policy skip)" in (run.dir / "logs" / "worker1.log").read_text()


def test_nan_policy_fail_ends_the_job_at_once_with_the_reason(tmp_path):
    run_dir = tmp_path / "run"
    workers = [WorkerSpec(ms_per_step=20.0), WorkerSpec(ms_per_step=20.0, extra=("--fault-nan-at", "4"))]
    # no --nan-policy: fail is the default; the stall timeout is far above the time the failure takes
    with start_cluster(run_dir, [*SLOW, "--stall-timeout", "120"], workers) as cluster:
        code = cluster.procs["scheduler"].wait(timeout=JOB_TIMEOUT_S)
        worker_codes = [cluster.procs[f"worker{i}"].wait(timeout=30 * WAIT_FACTOR) for i in range(2)]
    assert code == 1 and worker_codes[1] == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"].startswith("failed: worker 1's gradient at step 4 has NaN or inf values")
    assert summary["nonfinite_gradients"] == 1 and summary["worker_steps"][1] == 4
    assert "--nan-policy fail" in (run_dir / "logs" / "worker1.log").read_text()


@pytest.mark.parametrize("mode", ["bsp", "asp"])
def test_a_server_started_again_takes_the_lost_shard_and_the_job_goes_back_to_the_checkpoint(tmp_path, mode):
    run_dir = tmp_path / "run"
    workers = [WorkerSpec(ms_per_step=20.0)] * 2
    every = 10
    job = ["--mode", mode, "--epochs", "6", "--global-batch", "32", "--lr", "0.05",
           "--seed", "5", "--heartbeat", "0.3", "--dead-after", "3", "--checkpoint-every", str(every)]
    with start_cluster(run_dir, job, workers, num_servers=2) as cluster:
        wait_for_steps(run_dir, 2 * 35)
        cluster.procs["server1"].send_signal(signal.SIGKILL)
        if mode == "bsp":  # started again once the loss is known, or at once (as a supervisor would)
            wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["change"] == "lost")
        cluster.start_server("server1-again")  # the same command line
        run = finish(cluster, expect_ok=False)
    assert run.code == 0, run.logs()
    s = run.summary
    assert s["status"] == "completed" and s["server_restores"] == 1 and s["final_test_accuracy"] >= 0.90
    rewind = [e for e in run.events if e["event"] == "rewind"]
    assert len(rewind) == 1 and rewind[0]["step"] % every == 0 and rewind[0]["step"] >= every
    assert 0 <= rewind[0]["steps_lost"] <= 2 * every  # the newest complete checkpoint, one may be in writing
    after = [e for e in run.events if e["event"] == "step" and e["t"] > rewind[0]["t"]]
    for w in (0, 1):  # each worker goes on at its step of the checkpoint
        assert min(e["step"] for e in after if e["worker"] == w) == rewind[0]["worker_steps"][w]
    if mode == "bsp":
        assert rewind[0]["worker_steps"] == [rewind[0]["step"]] * 2 and s["steps"] == math.ceil(6 * 1438 / 32)
    codes = run.cluster.exit_codes()
    assert codes["server1"] == -signal.SIGKILL and all(c == 0 for n, c in codes.items() if n != "server1"), codes
    if mode == "bsp":  # the replayed steps read the same data in the same order, none is learned twice: the
        # model of the same steps in one process (4e-7 apart when measured; a step applied twice moves it by 1e-3)
        assert_trained_as_one_process(run.dir, steps=s["steps"], global_batch=32, lr=0.05, seed=5)


