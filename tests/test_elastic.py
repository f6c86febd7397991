"""Elastic workers end to end: a worker killed mid-run leaves the job, one started later joins it."""

import signal
from collections import defaultdict
from contextlib import ExitStack

import pytest
import torch

from omnips.launch import WorkerSpec

from helpers import WAIT_FACTOR, finish, in_log, start_cluster, stopped, wait_for_event, wait_for_steps

pytestmark = pytest.mark.cluster  # every test here starts processes

LIVENESS = ["--heartbeat", "0.3", "--dead-after", "3"]  # short, with room for a loaded host
# a joiner's process may take longer to start (torch import on a loaded host) than the job has
# left, so the others wait frozen until it has registered: longer than that is not taken for dead
JOIN_WAIT_S = 60
PATIENT = ["--heartbeat", "0.3", "--dead-after", str(JOIN_WAIT_S + 30)]


def _batches_by_step(events) -> dict[int, dict[int, int]]:
    steps = defaultdict(dict)
    for e in events:
        if e["event"] == "step":
            steps[e["step"]][e["worker"]] = e["batch"]
    return steps


def _kill_mid_run(run_dir, job, workers, victim: str, after_reports: int):
    """Run `job`, SIGKILL worker `victim` once `after_reports` step reports are in; the
    run once the scheduler has ended it, which must be a success."""
    with start_cluster(run_dir, [*job, *LIVENESS], workers) as cluster:
        wait_for_steps(run_dir, after_reports)
        cluster.procs[victim].send_signal(signal.SIGKILL)
        run = finish(cluster, expect_ok=False)
    assert run.code == 0, run.logs()
    return run


@pytest.mark.core
def test_a_killed_bsp_worker_leaves_and_the_others_carry_the_global_batch(tmp_path):
    job = ["--mode", "bsp", "--epochs", "5", "--global-batch", "48", "--lr", "0.1", "--seed", "3"]
    run = _kill_mid_run(tmp_path / "run", job, [WorkerSpec(ms_per_step=15.0)] * 3, "worker2", 3 * 15)
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 1 and s["workers_joined"] == 0
    assert s["final_batches"][2] == 0 and sum(s["final_batches"]) == 48
    assert s["final_test_accuracy"] >= 0.90
    events = run.events
    lost = [e for e in events if e["event"] == "membership" and e["change"] == "lost"]
    assert len(lost) == 1 and lost[0]["rank"] == 2 and "silent" in lost[0]["reason"]
    replan = [e for e in events if e["event"] == "assign" and e["reason"] == "lost"]
    assert replan and replan[0]["batches"][2] == 0 and sum(replan[0]["batches"]) == 48
    # every step after the survivors switched trains on the whole global batch, in two workers
    steps = _batches_by_step(events)
    last = max(steps)
    switched = min(s for s, ws in steps.items() if 2 not in ws and sum(ws.values()) == 48)
    assert all(sum(steps[t].values()) == 48 and set(steps[t]) == {0, 1} for t in range(switched, last + 1))
    assert switched - lost[0]["last_step"] <= 3  # the barrier waits out the detection; then one step without it
    codes = run.cluster.exit_codes()
    assert codes["worker2"] == -signal.SIGKILL and all(codes[n] == 0 for n in codes if n != "worker2"), codes


def _join_while_the_others_wait(cluster, run_dir, rank: int) -> None:
    """Start worker `rank` into the running job, the workers already there frozen (SIGSTOP)
    until the scheduler has taken its registration."""
    with ExitStack() as frozen:
        for name in [n for n in cluster.procs if n.startswith("worker")]:
            frozen.enter_context(stopped(cluster.procs[name]))
        cluster.add_worker(WorkerSpec(ms_per_step=15.0), rank=rank)
        wait_for_event(run_dir, lambda e: e["event"] == "membership" and e.get("late") and e["rank"] == rank,
                       JOIN_WAIT_S)


def test_a_worker_started_later_joins_at_a_step_boundary_and_gets_a_share(tmp_path):
    run_dir = tmp_path / "run"
    first = [WorkerSpec(ms_per_step=15.0)] * 2
    steps_in_all = 300
    job = ["--mode", "bsp", "--max-steps", str(steps_in_all), "--global-batch", "48", "--min-workers", "2",
           "--seed", "4", *PATIENT]
    with start_cluster(run_dir, job, first, ranks=3) as cluster:
        wait_for_steps(run_dir, 2 * 20)
        _join_while_the_others_wait(cluster, run_dir, 2)
        run = finish(cluster)
    s = run.summary
    assert s["status"] == "completed" and s["workers_joined"] == 1 and s["workers_lost"] == 0
    assert s["steps"] == steps_in_all and s["samples"] == steps_in_all * 48  # every step trained on all of B
    steps = _batches_by_step(run.events)
    joined = min(t for t, ws in steps.items() if 2 in ws)
    assert 20 <= joined < steps_in_all and all(2 not in steps[t] for t in range(joined))
    assert all(set(steps[t]) == {0, 1, 2} and sum(steps[t].values()) == 48 for t in range(joined, steps_in_all))
    assert s["final_batches"] == [16, 16, 16] and s["worker_steps"][2] == steps_in_all - joined
    late = [e for e in run.events if e["event"] == "membership" and e.get("late")]
    assert [e["rank"] for e in late] == [2]
    # the plan that seats it, decided before the step it joins at
    seated = [e for e in run.events if e["event"] == "assign" and e["reason"] == "joined"]
    assert len(seated) == 1 and seated[0]["batches"] == [16, 16, 16] and seated[0]["step"] <= joined, seated


def test_a_killed_ssp_worker_does_not_hold_the_others(tmp_path):
    job = ["--mode", "ssp", "--staleness", "2", "--max-steps", "80", "--global-batch", "30"]
    run = _kill_mid_run(tmp_path / "run", job, [WorkerSpec(ms_per_step=10.0)] * 3, "worker1", 3 * 10)
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 1 and s["samples"] >= 80 * 30
    assert s["final_batches"][1] == 0 and sum(s["final_batches"]) == 30
    lost_at = next(e["t"] for e in run.events if e["event"] == "membership" and e["change"] == "lost")
    assert any(e["event"] == "step" and e["worker"] == 0 and e["t"] > lost_at for e in run.events)


def test_an_asp_worker_lost_after_the_others_finished_still_ends_the_job_with_its_model(tmp_path):
    # worker 2 freezes near the end; the others take the rest of the sample budget and report
    # done before it is found silent: its loss is what completes the job, and asks the final evaluation
    run_dir = tmp_path / "run"
    job = ["--mode", "asp", "--max-steps", "200", "--global-batch", "48", "--lr", "0.02", "--seed", "5",
           "--heartbeat", "0.3", "--dead-after", "10"]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=15.0)] * 3) as cluster:
        wait_for_steps(run_dir, 3 * 150)  # of about 3 x 200
        victim = cluster.procs["worker2"]
        with stopped(victim):
            log = run_dir / "logs" / "scheduler.log"
            for rank in (0, 1):
                in_log(log, f"worker {rank} finished")
            assert "worker 2 lost" not in log.read_text(), "worker 2 was found silent before the others finished"
            victim.send_signal(signal.SIGKILL)
        run = finish(cluster, expect_ok=False)
    assert run.code == 0, run.logs()
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 1 and s["samples"] >= 200 * 48
    assert s["final_test_accuracy"] is not None and s["final_test_accuracy"] >= 0.8
    kinds = [(e["event"], e.get("change"), e.get("final")) for e in run.events]
    assert kinds.index(("membership", "lost", None)) < kinds.index(("eval", None, True))
    state = torch.load(run_dir / "model.pt")
    assert state and all(torch.isfinite(v).all() for v in state.values())
    codes = run.cluster.exit_codes()
    assert codes["worker2"] == -signal.SIGKILL and all(codes[n] == 0 for n in codes if n != "worker2"), codes


def test_a_worker_lost_during_the_probe_does_not_hold_the_others(tmp_path):
    # worker 2's virtual device takes 4 s for any pass: it is killed inside its probe
    workers = [WorkerSpec(ms_per_step=2, ms_per_sample=1), WorkerSpec(ms_per_step=2, ms_per_sample=2),
               WorkerSpec(ms_per_step=4000)]
    job = ["--mode", "bsp", "--batching", "dynamic", "--max-steps", "30", "--global-batch", "48", *LIVENESS]
    run_dir = tmp_path / "run"
    with start_cluster(run_dir, job, workers) as cluster:
        for rank in (0, 1):
            wait_for_event(run_dir, lambda e, r=rank: e["event"] == "probe" and e["worker"] == r)
        cluster.procs["worker2"].send_signal(signal.SIGKILL)
        run = finish(cluster, expect_ok=False)
    assert run.code == 0, run.logs()
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 1 and s["steps"] == 30
    assert not any(e["event"] == "probe" and e["worker"] == 2 for e in run.events)
    start = [e for e in run.events if e["event"] == "assign" and e["reason"] == "probe"]
    assert len(start) == 1 and start[0]["batches"][2] == 0 and sum(start[0]["batches"]) == 48
    assert start[0]["batches"][0] > start[0]["batches"][1]  # the faster device gets more
    first = {e["worker"]: e["batch"] for e in run.events if e["event"] == "step" and e["step"] == 0}
    assert first == {0: start[0]["batches"][0], 1: start[0]["batches"][1]}


def test_a_worker_started_later_joins_an_asp_job(tmp_path):
    run_dir = tmp_path / "run"
    job = ["--mode", "asp", "--max-steps", "400", "--global-batch", "48", "--min-workers", "2", "--lr", "0.02",
           "--seed", "4", *PATIENT]
    with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=15.0)] * 2, ranks=3) as cluster:
        wait_for_steps(run_dir, 2 * 20)
        _join_while_the_others_wait(cluster, run_dir, 2)
        run = finish(cluster)
    s = run.summary
    assert s["status"] == "completed" and s["workers_joined"] == 1 and s["workers_lost"] == 0
    assert s["final_batches"] == [16, 16, 16] and s["samples"] >= 400 * 48
    joined = [e for e in run.events if e["event"] == "step" and e["worker"] == 2]
    assert joined and s["worker_steps"][2] == len(joined)
    # ASP: the joiner starts at the slowest present worker's step and pushes from there, each step once
    steps = [e["step"] for e in joined]
    assert steps == list(range(steps[0], steps[0] + len(steps))) and steps[0] >= 20
    assert s["final_test_accuracy"] >= 0.85


@pytest.mark.parametrize("slow, others", [
    (WorkerSpec(ms_per_step=40.0), WorkerSpec(ms_per_step=10.0)),  # mostly computing: it has not pushed
    (WorkerSpec(), WorkerSpec(ms_per_step=30.0)),  # mostly waiting for the others: a reply to it is due
], ids=["frozen-computing", "frozen-waiting"])
def test_a_worker_that_was_only_slow_is_refused_when_it_wakes_and_exits_with_the_reason(tmp_path, slow, others):
    run_dir = tmp_path / "run"
    steps = 120
    job = ["--mode", "bsp", "--max-steps", str(steps), "--global-batch", "48", "--seed", "3", *LIVENESS]
    with start_cluster(run_dir, job, [others, others, slow]) as cluster:
        wait_for_steps(run_dir, 3 * 15)
        woken = cluster.procs["worker2"]
        with stopped(woken):  # frozen for longer than --dead-after: taken for dead
            lost = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["change"] == "lost", 30)
        # it wakes in the middle of a step of the old plan
        woken_code = woken.wait(timeout=30 * WAIT_FACTOR)
        run = finish(cluster, expect_ok=False)
    assert lost["role"] == "worker" and lost["rank"] == 2 and "silent" in lost["reason"], (lost, run.logs())
    log = (run_dir / "logs" / "worker2.log").read_text()
    # refused by the server ("removed: worker 2 was removed from the job after step N") or told by the
    # scheduler ("removed from the job: silent for N s"), whichever it hears first
    assert woken_code == 1 and "removed from the job" in log.splitlines()[-1], (woken_code, log[-2000:])
    # the others went on without it and completed the job
    assert run.code == 0, run.logs()
    codes = run.cluster.exit_codes()
    assert codes["worker0"] == 0 and codes["worker1"] == 0 and codes["server0"] == 0, codes
    s = run.summary
    assert s["status"] == "completed" and s["steps"] == steps and s["workers_lost"] == 1
    assert s["final_batches"][2] == 0 and sum(s["final_batches"]) == 48
    assert s["worker_steps"][2] == lost["last_step"] + 1  # nothing it did once awake counted
