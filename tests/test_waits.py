"""A stalled job says what it waits for: the rank a step waits for, a lost server's
replacement; and processes that lose the scheduler stop training at once.

Real processes; SIGSTOP freezes one (a process slow, not dead)."""

import json
import re
import signal
from pathlib import Path

import pytest

from omnips.launch import WorkerSpec
from omnips.metrics import read_events

from helpers import (JOB_TIMEOUT_S, WAIT_FACTOR, error_lines, finish, start_cluster, stopped, wait_for_event,
                     wait_for_steps)

pytestmark = pytest.mark.cluster  # every test here starts processes

ENDLESS = ["--mode", "bsp", "--max-steps", "100000", "--global-batch", "24"]


def _named(run_dir, role: str, rank: int) -> dict:
    return wait_for_event(run_dir, lambda e: e["event"] == "wait" and e["change"] == "waits" and e["role"] == role
                          and e["rank"] == rank, 30)


@pytest.mark.core
def test_a_stopped_worker_and_a_stopped_server_are_named_with_the_step_that_waits_for_them(tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--max-steps", "150", "--global-batch", "24", "--heartbeat", "0.25", "--dead-after", "30"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 3, num_servers=2) as cluster:
        wait_for_steps(run_dir, 3 * 10)
        with stopped(cluster.procs["worker2"]):
            worker = _named(run_dir, "worker", 2)
        went_on = wait_for_event(run_dir, lambda e: e["event"] == "wait" and e["change"] == "went on", 30)
        frozen = cluster.procs["server1"]
        rank = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["pid"] == frozen.pid)["rank"]
        with stopped(frozen):  # ranked in registration order: not necessarily 1
            server = _named(run_dir, "server", rank)
        run = finish(cluster)
    steps = [e for e in run.events if e["event"] == "step"]
    host = next(e["host"] for e in run.events if e["event"] == "membership" and e["role"] == "worker")
    # the step in flight when it stopped: the one after the last it reported, or after that
    # when its last push left but its report was still on the way (the link's thread stopped too)
    assert worker["host"] == host and worker["device"] == "cpu" and worker["seconds"] > 0.25, worker
    done = [e["step"] for e in steps if e["worker"] == 2 and e["t"] < worker["t"]]
    assert worker["step"] in (max(done) + 1, max(done) + 2), (worker, done)
    assert worker["step"] - 1 in [e["step"] for e in steps if e["worker"] == 2]  # it had pushed the step before
    assert (went_on["rank"], went_on["step"]) == (2, worker["step"]) and went_on["seconds"] >= worker["seconds"]
    assert server["role"] == "server" and server["device"] == "" and server["host"], server
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 0 and s["server_restores"] == 0, s
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert re.search(rf"(INFO|WARNING) step {worker['step']} waits for worker 2 \({re.escape(host)}, cpu\) for \d+\.\d s",
                     log), log[-3000:]
    assert re.search(rf"(INFO|WARNING) step \d+ waits for server {rank} \(\S+\) for \d+\.\d s", log), log[-3000:]


def test_a_lost_server_nobody_replaces_is_waited_for_aloud_and_fails_the_job_with_that_reason(tmp_path):
    run_dir = tmp_path / "run"
    job = [*ENDLESS, "--checkpoint-every", "5", "--heartbeat", "0.25", "--dead-after", "2"]
    workers = [WorkerSpec(ms_per_step=20.0, extra=("--server-timeout", "14"))] * 2
    with start_cluster(run_dir, job, workers, num_servers=2) as cluster:
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint" and e["complete"])
        cluster.procs["server1"].send_signal(signal.SIGKILL)
        code = cluster.procs["scheduler"].wait(timeout=JOB_TIMEOUT_S)
        run = finish(cluster, expect_ok=False)
    assert code == 1
    status = json.loads((run_dir / "summary.json").read_text())["status"]
    assert re.fullmatch(r"failed: server \d on \S+ \(has been silent for \d s\) was lost \d+ s ago and no server took "
                        r"its shard: every worker gave up waiting \(the last, worker \d: failed: worker \d on \S+: "
                        r"no answer from server \d at \S+(, server \d at \S+)? within 14 s\); start the "
                        r"processes again "
                        rf"with --resume {re.escape(str(run_dir))} on the scheduler", status), status
    log = (run_dir / "logs" / "scheduler.log").read_text()
    said = re.findall(r"WARNING the job waits for a server to take the shard of server \d on \S+ \(has been silent for "
                      r"\d s\): start one with the server's command line; the workers give up after their "
                      r"--server-timeout \((\d+) s since the loss\)", log)
    assert len(said) >= 2 and said == sorted(said, key=int), log[-3000:]
    lost = [e for e in run.events if e["event"] == "membership" and e["change"] == "lost"]
    assert [e["role"] for e in lost] == ["server", "worker", "worker"], lost


def _incomplete_checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(d.name for d in root.iterdir() if d.is_dir() and not (d / "manifest.json").exists()
                  and any(d.glob("shard-*.ckpt")))


def test_after_the_scheduler_dies_workers_take_no_step_it_cannot_record(tmp_path):
    run_dir = tmp_path / "run"
    # a step every 100 ms and a checkpoint asked at every one: --dead-after (4 s) of training on would
    # leave about 40 checkpoints that no manifest completes
    job = [*ENDLESS, "--checkpoint-every", "1", "--heartbeat", "0.25", "--dead-after", "4"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=100.0)] * 2) as cluster:
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint" and e["complete"] and e["step"] >= 3)
        cluster.procs["scheduler"].send_signal(signal.SIGKILL)
        others = {n: p for n, p in cluster.procs.items() if n != "scheduler"}
        codes = {n: p.wait(timeout=30 * WAIT_FACTOR) for n, p in others.items()}
    assert codes == {n: 1 for n in others}, codes
    logs = [(run_dir / "logs" / f"worker{w}.log").read_text() for w in range(2)]
    # one worker's hold is enough: in BSP the other then waits at the barrier for its push
    assert any(re.search(r"no word from the scheduler for \d\.\d s: step \d+ waits until it is heard", log)
               for log in logs), logs
    for log in logs:
        errors = error_lines(log)
        assert len(errors) == 1 and errors[0].startswith("no word from the scheduler at"), errors
    complete = [e["step"] for e in read_events(run_dir) if e["event"] == "checkpoint" and e["complete"]]
    incomplete = _incomplete_checkpoints(run_dir)
    # the steps under way when it died, and those of its last two heartbeat intervals: not --dead-after's
    assert len(incomplete) <= 8, (incomplete, complete)
