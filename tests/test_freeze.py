"""Processes that pause (a long GC, a debugger, a process starved of CPU: here SIGSTOP) and wake.

Frozen for less than --dead-after, a process costs the job only the time it was frozen;
frozen for longer, it is taken for gone, and when it wakes it is told so and ends with the
reason, as is the scheduler, which the others gave up on."""

import json
import re
import time

import pytest

from omnips.launch import WorkerSpec
from omnips.metrics import read_events

from helpers import (WAIT_FACTOR, assert_trained_as_one_process, error_lines, finish, start_cluster, stopped,
                     wait_for_event, wait_for_steps)

pytestmark = pytest.mark.cluster  # every test here starts processes

FREEZE_S = 1.5  # the freeze itself: the process is stopped, nothing is waited for
LIVENESS = ["--heartbeat", "0.25", "--dead-after", "4"]


def test_a_process_frozen_for_less_than_dead_after_costs_the_job_nothing(tmp_path):
    run_dir = tmp_path / "run"
    steps, batch = 120, 8
    job = ["--mode", "bsp", "--max-steps", str(steps), "--global-batch", str(batch), "--lr", "0.05", "--seed", "5",
           *LIVENESS]
    # the workers would give up on a server silent for 4 s: the frozen server is waited for, not given up on
    workers = [WorkerSpec(ms_per_step=25.0, extra=("--server-timeout", "4"))] * 2
    with start_cluster(run_dir, job, workers) as cluster:
        for victim in ("worker1", "server0", "scheduler"):  # one after the other, 15 steps apart
            wait_for_steps(run_dir, len([e for e in read_events(run_dir) if e["event"] == "step"]) + 2 * 15)
            assert cluster.poll() is None
            with stopped(cluster.procs[victim]):
                time.sleep(FREEZE_S)  # the freeze itself
        run = finish(cluster)  # every process exits 0
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 0 and s["workers_joined"] == 0, s
    assert s["server_restores"] == 0
    assert s["steps"] == steps and s["worker_steps"] == [steps, steps] and s["samples"] == steps * batch
    assert not [e for e in run.events if e["event"] == "membership" and e["change"] == "lost"]
    times = [e["t"] for e in run.events if e["event"] == "step"]
    assert sum(b - a >= 0.9 * FREEZE_S for a, b in zip(times, times[1:])) == 3  # each freeze held the job
    assert " ERROR " not in run.logs() and " WARNING " not in run.logs(), run.logs()
    # and nothing was learned twice or lost: the model of the same steps in one process
    assert_trained_as_one_process(run.dir, steps=steps, global_batch=batch, lr=0.05, seed=5)


def test_a_scheduler_frozen_for_longer_than_dead_after_is_given_up_on_and_ends_with_the_reason_when_it_wakes(
        tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "bsp", "--max-steps", "100000", "--global-batch", "8", "--heartbeat", "0.25",
           "--dead-after", "3"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 2) as cluster:
        wait_for_steps(run_dir, 2 * 4)
        scheduler = cluster.procs["scheduler"]
        others = {n: p for n, p in cluster.procs.items() if n != "scheduler"}
        with stopped(scheduler):
            stopped_at = time.monotonic()
            codes = {n: p.wait(timeout=30 * WAIT_FACTOR) for n, p in others.items()}  # each gives up on it
            gave_up_after = time.monotonic() - stopped_at
        code = scheduler.wait(timeout=30 * WAIT_FACTOR)
    assert codes == {n: 1 for n in others} and gave_up_after > 3, (codes, gave_up_after)  # not before --dead-after
    for name in others:
        log = (run_dir / "logs" / f"{name}.log").read_text()
        errors = error_lines(log)  # one line, the reason
        assert len(errors) == 1 and "Traceback" not in log, log[-2000:]
        # (a worker whose step waited at the barrier for the other, held by the silence, says so)
        assert re.fullmatch(rf"no word from the scheduler at {re.escape(cluster.endpoint)} for [34] s"
                            r"( \(while waiting for servers\))?: giving up", errors[0]), errors
    # woken, it finds that it was silent for longer than the others wait, and ends with that reason (not
    # with theirs, having found them silent --dead-after later)
    assert code == 1, code
    status = json.loads((run_dir / "summary.json").read_text())["status"]
    reason = (r"the scheduler sent nothing for \d+ s \(it was stalled: stopped, or starved of CPU\), longer than "
              r"--dead-after \(3 s\), after which the servers and workers give up on it")
    assert re.fullmatch(f"failed: {reason}", status), status
    log = (run_dir / "logs" / "scheduler.log").read_text()
    assert error_lines(log) == [f"job {status}"] and "Traceback" not in log, log[-2000:]


def test_a_server_frozen_past_dead_after_is_told_it_was_removed_when_it_wakes_and_a_server_started_again_takes_over(
        tmp_path):
    run_dir = tmp_path / "run"
    steps, batch = 40, 8
    job = ["--mode", "bsp", "--max-steps", str(steps), "--global-batch", str(batch), "--lr", "0.05", "--seed", "5",
           "--checkpoint-every", "5", "--heartbeat", "0.25", "--dead-after", "3"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 2, num_servers=2) as cluster:
        wait_for_event(run_dir, lambda e: e["event"] == "checkpoint" and e["complete"])
        woken = cluster.procs["server0"]
        with stopped(woken):  # a step in flight: the workers' pushes wait for it
            lost = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["change"] == "lost", 30)
        woken_code = woken.wait(timeout=15 * WAIT_FACTOR)  # it ends, having served nothing
        # the job waits for a server to take the shard: nobody else gave up
        running = {n: p.poll() for n, p in cluster.procs.items() if n != "server0"}
        cluster.start_server("server0-again")
        run = finish(cluster, expect_ok=False)
    assert lost["role"] == "server" and lost["pid"] == woken.pid and "silent" in lost["reason"], lost
    log = (run_dir / "logs" / "server0.log").read_text()
    assert woken_code == 1 and "Traceback" not in log, (woken_code, log[-2000:])
    assert re.fullmatch(rf"scheduler ended the job: removed from the job: server {lost['rank']} has been silent "
                        rf"for \d+ s", "\n".join(error_lines(log))), log[-2000:]
    assert running == {n: None for n in running}, (running, run.logs())
    assert run.code == 0, run.logs()
    codes = run.cluster.exit_codes()
    assert codes["server0"] == 1 and all(c == 0 for n, c in codes.items() if n != "server0"), codes
    s = run.summary
    assert s["status"] == "completed" and s["server_restores"] == 1 and s["workers_lost"] == 0, s
    assert s["steps"] == steps and s["worker_steps"] == [steps, steps]
    [rewind] = [e for e in run.events if e["event"] == "rewind"]
    assert rewind["step"] >= 5 and rewind["worker_steps"] == [rewind["step"]] * 2
    # the steps replayed from the checkpoint read the same data: the model of the same steps in one process
    assert_trained_as_one_process(run.dir, steps=steps, global_batch=batch, lr=0.05, seed=5)
