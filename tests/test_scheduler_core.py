"""The scheduler's pure core driven with events, the clock passed in, no sockets: what it
tells whom (instructions) for the start plan from the workers' probes, refusals, a server
that cannot restore its shard or registers for a shard that has one, heartbeats, silences,
failures, evaluations and the end of the job."""

import contextlib
import functools

import numpy as np
import pytest

from omnips.batching import BatchPlan
from omnips.job import JobSpec
from omnips.protocol import (Error, Failed, Heartbeat, Leave, Params, Plan, Probe, Register, Report, Saved,
                             Shutdown, Welcome)
from omnips.scheduler.core import SchedulerCore
from omnips.scheduler.instructions import AskEval, ConnectServers, Evaluate, Finish, Send, WriteEvent

from scheduler_helpers import PARAMS, events, register, scheduler_core, sent, step_report


@pytest.fixture
def make(tmp_path):
    return functools.partial(scheduler_core, tmp_path)


def probe(c, peer, rank, a, b, now=0.0, **memory) -> list:
    return c.handle(peer, Probe(rank=rank, batches=[2, 4], seconds=[a + 2 * b, a + 4 * b], **memory), now)


def refusal(out) -> str | None:
    """The code of the one Error the instructions hold when that is all they hold."""
    return out[0].msg.code if len(out) == 1 and isinstance(out[0].msg, Error) else None


def test_the_start_plan_waits_for_every_probe_and_refuses_the_others(make):
    c = make(num_workers=2, global_batch=60)
    for r in range(2):
        register(c, b"W%d" % r, "worker", r)
    assert c.planner.probing == {0, 1} and c.planner.plan.gen == 0
    assert refusal(probe(c, b"X", 0, 0.1, 0.1)) == "bad_rank"  # not a registered peer
    assert refusal(probe(c, b"W1", 0, 0.1, 0.1)) == "bad_rank"  # another worker's rank
    assert sent(probe(c, b"W0", 0, 0.005, 0.001)) == [] and c.planner.probing == {1}
    assert refusal(probe(c, b"W0", 0, 0.1, 0.1)) == "bad_step"  # twice
    out = probe(c, b"W1", 1, 0.005, 0.002)
    start = Plan(plan=BatchPlan(1, (40, 20)))
    assert sent(out, b"S", Plan) == [start] and sent(out, b"W0") == sent(out, b"W1") == [start]
    assert [e["batches"] for e in events(out, "assign")] == [[40, 20]]
    assert refusal(probe(c, b"W1", 1, 0.1, 0.1)) == "bad_step"  # after the start


def test_cpu_workers_under_a_quota_share_one_shape_of_probe_line_and_a_gpu_worker_keeps_its_own(make):
    c = make(num_workers=3, global_batch=96)
    for r, device in enumerate(["cpu", "cpu", "cuda:0"]):
        c.handle(b"W%d" % r, Register(role="worker", host="h", rank=r, device=device), 0.0)
    for r, (a, b) in enumerate([(0.0, 0.01), (0.02, 0.01), (0.05, 0.001)]):  # every one in a 0.5-core pod
        c.handle(b"W%d" % r, Probe(rank=r, batches=[2, 4], seconds=[a + 2 * b, a + 4 * b], quota=0.5), 0.0)
    lines = c.planner.control.models.lines([0, 1, 2])
    # the CPU workers' own fixed costs, 0 and 2 samples' time: both lines take their median, 1
    assert lines[0, 0] / lines[0, 1] == pytest.approx(1.0) and lines[1, 0] / lines[1, 1] == pytest.approx(1.0)
    assert tuple(lines[2]) == (pytest.approx(0.05), pytest.approx(0.001))


def test_a_probe_of_a_worker_gone_does_not_stand_for_whoever_takes_its_rank(make):
    c = make(num_workers=3, global_batch=60, min_workers=2)
    for r in range(2):
        register(c, b"W%d" % r, "worker", r)
    probe(c, b"W1", 1, 0.005, 0.010, mem_free=200_000, sample_bytes=10_000)  # slow, short of memory
    assert sent(c.handle(b"W1", Failed(reason="gone"), 1.0), b"W1") == [Shutdown(ok=False, reason="removed from "
                                                                                 "the job: failed: gone")]
    register(c, b"NEW", "worker", 1, now=2.0)  # takes rank 1 while worker 0 still probes: it does not probe
    [plan] = [m.plan for m in sent(probe(c, b"W0", 0, 0.005, 0.001, now=3.0), b"NEW", Plan)]
    assert c.planner.control.max_batch[1] == 60 and not c.planner.control.models.measured([1])[0]
    # the newcomer is taken as fast as the typical worker at its batch, not as the one gone
    assert abs(plan.batches[1] - 30) <= 3 and sum(plan.batches) == 60, plan


def test_workers_that_joined_during_the_probe_go_on_when_every_prober_left(make):
    c = make(num_workers=2, global_batch=32, min_workers=1, mode="asp")
    register(c, b"W0", "worker", 0)
    assert c.planner.probing == {0}
    out = register(c, b"W1", "worker")  # joins while worker 0 probes
    assert Welcome in [type(m) for m in sent(out, b"W1")]
    out = c.handle(b"W0", Failed(reason="gone"), 1.0)  # before its probe: nothing to plan from
    assert not c.planner.probing and [p.plan.batches for p in sent(out, b"W1", Plan)] == [(0, 32)]


def test_a_memory_bound_from_a_probe_holds_inside_the_deadband(make):
    c = make(num_workers=3, global_batch=120, deadband=0.2)
    for r in range(3):
        register(c, b"W%d" % r, "worker", r)
    # equal speeds: the plan stays 40/40/40 by the deadband, but worker 0's memory holds 39
    # 0.8 x 296,250 B free / 3 workers on the host / (2 x 1000 B a sample) -> 39 samples
    probe(c, b"W0", 0, 0.005, 0.001, mem_free=296_250, sample_bytes=1000)
    probe(c, b"W1", 1, 0.005, 0.001)
    [plan] = [m.plan for m in sent(probe(c, b"W2", 2, 0.005, 0.001), b"S", Plan)]
    assert c.planner.control.max_batch[0] == 39
    assert plan.batches[0] <= 39 and sum(plan.batches) == 120


def test_a_server_that_cannot_restore_its_shard_fails_the_job_at_once(make, tmp_path):
    from omnips.server.service import _restore
    from omnips.server.shard import ShardCore

    sent = []  # the server's side: its restore fails and it says so
    link = type("Link", (), {"send": lambda self, msg: sent.append(msg),
                             "in_phase": lambda self, phase: contextlib.nullcontext()})()
    shard = ShardCore(JobSpec(), 0, 4, 4)
    with pytest.raises(ValueError, match="no checkpoint|cannot read"):
        _restore(shard, 0, 0, 4, link, str(tmp_path / "no-such-checkpoint"))
    assert [type(m) for m in sent] == [Error] and sent[0].code == "restore_failed" and not shard.initialized
    c = make(num_workers=1)
    said = Error(code="restore_failed", text="server 0 cannot restore its shard: no checkpoint")
    assert refusal(c.handle(b"X", said, 0.0)) == "bad_op"  # from a peer that is no server: refused, nothing more
    assert c.handle(b"S", said, 0.0) == [Finish("failed: restore_failed: server 0 cannot restore its shard: "
                                                "no checkpoint")]


def test_a_server_registering_while_every_shard_has_one_is_refused_unless_one_missed_two_heartbeats(make):
    c = make(num_workers=1)
    register(c, b"W0", "worker", 0)
    assert c.registry.complete
    # server 0 is alive (heard 1 s ago): the newcomer is refused, nothing changes
    assert refusal(register(c, b"S2", "server", now=1.0)) is not None
    assert b"S2" not in c.registry.by_peer and [m.peer for m in c.registry.servers] == [b"S"]
    # server 0 last heard from 2.5 heartbeats ago, long before --dead-after (30 s): taken for lost
    # at once (here without a checkpoint, so the job fails with the reason)
    assert register(c, b"S3", "server", now=2.5)[-1] == Finish(
        "failed: server 0 at tcp://127.0.0.1:1 silent for 2.5 s when a new server registered")


def test_a_server_of_another_job_or_a_second_registration_removes_no_silent_server(make):
    c = make(num_workers=1, token="secret")
    register(c, b"W0", "worker", 0, token="secret")
    register(c, b"S2", "server", token="another", now=2.5)  # server 0 silent 2.5 s: would be taken for lost
    register(c, b"S", "server", token="secret", now=2.5)  # server 0's own connection, again
    assert [m.peer for m in c.registry.servers] == [b"S"] and not c.registry.vacant_servers
    assert b"S2" not in c.registry.by_peer


@pytest.mark.parametrize("mode", ["asp", "bsp"])
def test_a_report_of_a_batch_above_the_jobs_largest_is_refused_and_counts_nothing(make, mode):
    c = make(num_workers=2, global_batch=60, mode=mode, batching="uniform", probe=False)
    for rank in range(2):
        register(c, b"W%d" % rank, "worker", rank)
    before = (c.progress.samples, c.progress.workers[0].next_step, c.progress.budget_reached)
    report = step_report(0, 0, 61, compute_s=0.03)
    assert refusal(c.handle(b"W0", report, 1.0)) == "bad_batch"
    assert (c.progress.samples, c.progress.workers[0].next_step, c.progress.budget_reached) == before
    c.handle(b"W0", step_report(0, 0, 60, compute_s=0.03), 1.0)
    assert c.progress.samples == 60 and c.progress.workers[0].next_step == 1  # the largest is a batch


def test_a_scheduler_that_sent_nothing_for_longer_than_processes_wait_fails_the_job_saying_it_stalled(make):
    c = make(num_workers=1)  # --heartbeat 1, --dead-after 30: processes give up after 30 s and a heartbeat's grace
    assert sent(c.tick(0.0), b"S") == [Heartbeat()]  # the first: due at once
    # still forming: processes not yet welcomed wait 30 s, whatever --dead-after says
    assert sent(c.tick(100.0), b"S") == [Heartbeat()]
    register(c, b"W0", "worker", 0, now=100.0)
    assert c.registry.complete
    assert sent(c.tick(130.5), b"W0") == [Heartbeat()]  # the last heartbeats left 30.5 s ago: none gave up yet
    assert c.tick(162.0) == [Finish("failed: the scheduler sent nothing for 32 s (it was stalled: stopped, or "
                                    "starved of CPU), longer than --dead-after (30 s), after which the servers and "
                                    "workers give up on it")]  # 31.5 s ago: all have


def test_a_heartbeat_asking_for_an_echo_is_echoed_to_a_member_at_once(make):
    c = make(num_workers=1, global_batch=8)
    assert c.handle(b"S", Heartbeat(), 0.0) == []  # a plain one is not answered
    assert c.handle(b"S", Heartbeat(echo=7), 0.0) == [Send(b"S", Heartbeat(echo=7))]
    assert c.handle(b"X", Heartbeat(echo=8), 0.0) == []  # not a member (a server already removed): no answer


def test_a_stop_asked_again_ends_the_job_at_once(make):
    c = make(num_workers=1, global_batch=60)
    assert c.request_stop("SIGTERM")
    c.tick(0.0)  # begun: nothing trained yet, so it ends at the next turn
    assert c.ended(0.1) and c.outcome() == Finish("preempted", "SIGTERM at step 0: model.pt not written")
    assert not c.request_stop("SIGTERM")  # (the driver ends the job at once)


@pytest.mark.parametrize("why, begun", [("SIGTERM", False), ("SIGINT", True)])
def test_a_signal_after_a_servers_leave_joins_its_stop_and_only_a_second_signal_ends_the_job(make, why, begun):
    # a batch system signals every process at once: a server's leave may arrive before the scheduler's own
    # signal, before the stop it asks for has begun (at the next tick) or after
    c = make(num_workers=1, global_batch=60)
    register(c, b"W0", "worker", 0)
    c.handle(b"S", Leave(why=why), 1.0)
    assert c.stop_asked == f"{why} to server 0 on h"
    if begun:
        c.tick(2.0)
        assert c.stop is not None
    assert c.request_stop(why)  # the same stop: not a second ask
    assert begun or c.stop_asked == f"{why} to server 0 on h"
    c.tick(2.0)
    assert c.ended(2.1) and c.outcome().status == "preempted", c.outcome()
    assert c.outcome().stopped.startswith(f"{why} to server 0 on h at step 0"), c.outcome()
    assert not c.request_stop(why)  # the scheduler's second signal (the driver ends the job at once)


def test_a_worker_that_fails_says_why_and_the_scheduler_replans_at_once(make):
    c = make(num_workers=2, global_batch=60, batching="uniform")
    for r in range(2):
        register(c, b"W%d" % r, "worker", r)
    before = c.planner.plan
    assert c.handle(b"X", Failed(reason="not in the job"), 1.0) == []  # a stranger's word changes nothing
    assert c.planner.plan == before and set(c.registry.workers) == {0, 1}
    out = c.handle(b"W1", Failed(reason="worker 1 on h: this worker's model differs from the scheduler's"), 1.0)
    assert set(c.registry.workers) == {0} and c.lost == 1
    [lost] = [e for e in events(out, "membership") if e["change"] == "lost"]
    assert lost["rank"] == 1 and lost["reason"] == "failed: worker 1 on h: this worker's model differs from the " \
                                                   "scheduler's"
    assert sent(out, b"S", Plan) == [Plan(plan=BatchPlan(before.gen + 1, (60, 0)), departed=((1, -1),))]
    assert [type(m) for m in sent(out, b"W1")] == [Shutdown]


def test_a_silent_worker_is_named_with_the_phase_its_last_heartbeat_told(make):
    c = make(num_workers=2, global_batch=60, batching="uniform")
    for r in range(2):
        register(c, b"W%d" % r, "worker", r)
    c.handle(b"W1", Heartbeat(phase="building the model"), 9.0)
    for peer in (b"S", b"W0"):
        c.handle(peer, Heartbeat(), 39.0)
    assert not events(c.tick(39.0, unread=False), "membership")  # 30 s: not past --dead-after
    out = c.tick(40.0, unread=True)  # messages wait: silences are not judged
    assert not events(out, "membership")
    [lost] = events(c.tick(40.0), "membership")
    assert lost["rank"] == 1 and lost["reason"] == "silent for 31 s, last heard building the model", lost


def shard(request: int, version: int) -> Params:
    return Params(request=request, version=version, held_s=0.0, plan=None, data=np.zeros(PARAMS // 2, np.float32))


def test_bsp_asks_its_evaluations_in_advance_and_the_job_ends_once_the_final_one_is_evaluated(make):
    c = make(num_workers=1, num_servers=2, global_batch=500, epochs=2, batching="uniform", probe=False)
    out = register(c, b"S1", "server")
    assert out.index(ConnectServers()) < out.index(AskEval(1, 2)), out  # connected, then asked
    assert [i for i in out if isinstance(i, AskEval)] == [AskEval(1, 2), AskEval(2, 4)]  # an epoch is 2 steps
    register(c, b"W0", "worker", 0)
    assert c.server_reply(0, shard(2, 4), 1.0) == []  # one shard of two
    # the final version, in before the worker's last reports, is evaluated once the worker stopped:
    # the driver evaluates in its loop, and reports read after an evaluation of 1-2 s ended the job's
    # time that much later than its last step
    assert c.server_reply(1, shard(2, 4), 1.0) == []
    outs = [c.handle(b"W0", step_report(0, step, 500, done=step == 3), 2.0 + step) for step in range(4)]
    assert not [i for out in outs[:3] for i in out if isinstance(i, Evaluate)]
    [evaluate] = [i for i in outs[3] if isinstance(i, Evaluate)]
    assert evaluate.pending.final and not c.ended(5.0)
    [written] = c.evaluated(evaluate.pending, 0.9, 0.3, 5.0, 7.0)
    assert written == WriteEvent("eval", {"epoch": 2.0, "versions": [4, 4], "test_accuracy": 0.9, "test_loss": 0.3,
                                          "final": True})
    assert c.ended(7.0) and c.outcome() == Finish("completed")
    assert c.progress.last_end == 4.0  # the last step's report, not the evaluation's end
    out = c.finish("completed", None)
    assert sent(out, b"W0") == [Shutdown(ok=True, reason="completed")] and events(out, "end")


@pytest.mark.parametrize("answered", [True, False])
def test_a_checkpoint_in_flight_at_the_end_is_waited_for_within_the_server_timeout(make, tmp_path, answered):
    """The servers write a checkpoint's shards on a thread while training goes on, so the final
    evaluation's pull can be answered before the last checkpoint: the job waits for it (it ended
    without its manifest once, its shards on disk). A checkpoint unanswered within
    the servers' timeout (120 s) is given up with a warning; the job, its final model whole, completes."""
    c = make(num_workers=1, global_batch=500, epochs=2, batching="uniform", probe=False, checkpoint_every=2)
    register(c, b"W0", "worker", 0)
    [(request, asked)] = c.checkpoints.pending.items()  # asked in advance, once the server joined
    assert asked.step == 2
    for step in range(4):
        c.handle(b"W0", step_report(0, step, 500, done=step == 3), 1.0)
    [evaluate] = c.server_reply(0, shard(2, 4), 2.0)  # the final pull, answered after the worker stopped
    c.evaluated(evaluate.pending, 0.9, 0.3, 2.0, 2.0)
    assert not c.ended(2.0)
    if answered:
        shard_file = tmp_path / "run" / "checkpoints" / "step-2" / "shard-0.ckpt"
        shard_file.parent.mkdir(parents=True)
        shard_file.write_bytes(b"x" * 10)
        out = c.server_reply(0, Saved(request=request, step=2, version=2, size=10, sha256="0" * 64), 3.0)
        assert events(out, "checkpoint") == [{"step": 2, "complete": True, "error": None}]
        assert c.ended(3.0) and c.checkpoints.complete == 1
        return
    for now in range(2, 122, 10):
        assert not events(c.tick(float(now)), "checkpoint") and not c.ended(float(now))
    out = c.tick(123.0)
    assert events(out, "checkpoint") == [{"step": 2, "complete": False,
                                          "error": "servers did not answer within 120 s of the job's end"}]
    assert not [i for i in out if isinstance(i, Finish)]
    assert c.ended(123.0) and c.outcome() == Finish("completed") and c.checkpoints.complete == 0


def test_asp_reads_the_model_for_its_final_evaluation_once_every_worker_is_done(make):
    c = make(num_workers=2, global_batch=100, mode="asp", batching="uniform", probe=False, max_steps=1)
    for r in range(2):
        register(c, b"W%d" % r, "worker", r)
    done = [step_report(r, 0, 50, done=True) for r in range(2)]
    assert not [i for i in c.handle(b"W0", done[0], 1.0) if isinstance(i, AskEval)]
    assert [i for i in c.handle(b"W1", done[1], 1.0) if isinstance(i, AskEval)] == [AskEval(1, None)]
    for now in range(1, 121, 10):  # from the first tick on the servers have their timeout (120 s) to answer
        assert not [i for i in c.tick(float(now)) if isinstance(i, Finish)]
    assert c.tick(1.0 + 121.0)[-1] == Finish("failed: servers did not answer the final evaluation pull within 120 s")


def four_probed_alike(make) -> SchedulerCore:
    """A BSP job of four workers whose probes agree: the uniform split of 128."""
    c = make(num_workers=4, global_batch=128, max_steps=1000)
    for rank in range(4):
        register(c, b"W%d" % rank, "worker", rank)
    for rank in range(4):
        probe(c, b"W%d" % rank, rank, 0.035, 0.0325)
    assert c.planner.plan.batches == (32,) * 4
    return c


def test_bsp_decides_a_change_of_speed_once_every_worker_has_reported_the_step(make):
    """Worker 0 turns 1.9x as slow (a neighbour's hog in its cgroup; 2x, past FAR, would be a change
    at its first slow step): its second slow step is a change of speed at its first report of the
    step. The decision waits for the step's last report, so that every worker's latest step is in:
    under CPU quotas a slowdown of the whole host crossed one worker's tolerance a step before
    another's, and decided at the first report, the later one's window made it look 30 % faster
    and the plan gave it samples."""
    c = four_probed_alike(make)
    rng = np.random.default_rng(0)
    control = c.planner.control

    def report(step, rank, seconds):
        return c.handle(b"W%d" % rank, step_report(rank, step, c.planner.plan.batches[rank], compute_s=seconds),
                        1.5 * step)

    for step in range(30):
        for rank, t in enumerate(1.08 * (1 + rng.uniform(-0.02, 0.02, 4))):
            report(step, rank, float(t))
    assert c.planner.plan.batches == (32,) * 4 and not control.ready
    for rank, t in enumerate([2.05, 1.07, 1.09, 1.08]):
        report(30, rank, t)
    assert not control.ready
    report(31, 0, 2.07)
    assert control.ready  # worker 0 changed speed: the decision waits for the others' step 31
    for rank, t in ((1, 1.09), (2, 1.07)):
        assert events(report(31, rank, t), "assign") == [] and control.ready
    report(31, 3, 1.08)
    assert not control.ready  # decided
    assert c.planner.plan.batches[0] < 24 < 32 < min(c.planner.plan.batches[1:]), c.planner.plan.batches


def test_bsp_plans_for_each_worker_s_step_with_its_overhead_not_its_compute_alone(make):
    """Four workers compute equally fast; worker 3 spends 0.3 s a step outside compute and the
    servers' hold (under a CPU quota a thirtieth of a core's worker spent 90 ms a step moving
    its parameters, one at a quarter of a core 12 ms). Every step waits for its slowest worker's
    compute and overhead, so the plan gives worker 3 fewer samples, and the assign event's
    measured times are the steps' (compute and overhead)."""
    c = four_probed_alike(make)
    assigns = []
    for step in range(12):
        for rank in range(4):
            batch = c.planner.plan.batches[rank]
            out = c.handle(b"W%d" % rank, Report(rank=rank, step=step, batch=batch, compute_s=0.035 + 0.0325 * batch,
                                                 network_s=0.01, wait_s=0.0, loss=1.0,
                                                 overhead_s=0.3 if rank == 3 else 0.0), 1.5 * step)
            assigns += events(out, "assign")
    assert assigns, "no plan after a window"
    plan = c.planner.plan.batches
    assert plan[3] < 32 < min(plan[:3]), plan
    assert assigns[0]["step_s"][3] == pytest.approx(0.035 + 0.0325 * 32 + 0.3)
