"""The scheduler's message handlers driven in-process (no server or worker runs; replies
go to a socket without peers): the start plan from the workers' probes, a server that
cannot restore its shard, a server registering for a shard that has one, and heartbeats
asking for an echo."""

import contextlib
import time

import pytest

from omnips.job import JobSpec
from omnips.metrics import read_events
from omnips.protocol import Failed, Heartbeat, Plan, Probe, Register, Report
from scheduler import service
from scheduler.service import JobFailed, Scheduler, SchedulerOptions


@pytest.fixture
def make(tmp_path):
    made = []

    def scheduler(token="", **job) -> Scheduler:
        spec = JobSpec(**{"batching": "dynamic", "num_servers": 1, **job})
        spec.check()
        s = Scheduler(spec, SchedulerOptions(run_dir=str(tmp_path / f"run{len(made)}"), token=token),
                      announce=lambda *a: None)
        s._connect_servers = lambda: None  # no server runs: the scheduler's pulls have nobody to go to
        made.append(s)
        register(s, b"S", "server", token=token)
        return s

    yield scheduler
    for s in made:
        s.router.close(0)
        s.ctx.term()


def register(s, peer, role, rank=-1, token=""):
    s._on_register(peer, Register(role=role, host="h", endpoint="tcp://127.0.0.1:1" if role == "server" else "",
                                  rank=rank, token=token))


def probe(s, peer, rank, a, c, **memory):
    s._on_probe(peer, Probe(rank=rank, batches=[2, 4], seconds=[a + 2 * c, a + 4 * c], **memory))


def refused(s, peer, msg) -> bool:
    before = (set(s.planner.probing), dict(s.planner._probes), s.registry.plan)
    s._on_probe(peer, msg)
    return (set(s.planner.probing), dict(s.planner._probes), s.registry.plan) == before


def test_the_start_plan_waits_for_every_probe_and_refuses_the_others(make):
    s = make(num_workers=2, global_batch=60)
    for r in range(2):
        register(s, b"W%d" % r, "worker", r)
    assert s.planner.probing == {0, 1} and s.registry.plan.gen == 0
    assert refused(s, b"X", Probe(rank=0, batches=[2, 4], seconds=[0.1, 0.2]))  # not a registered peer
    assert refused(s, b"W1", Probe(rank=0, batches=[2, 4], seconds=[0.1, 0.2]))  # another worker's rank
    probe(s, b"W0", 0, 0.005, 0.001)
    assert s.registry.plan.gen == 0 and s.planner.probing == {1}
    assert refused(s, b"W0", Probe(rank=0, batches=[2, 4], seconds=[0.1, 0.2]))  # twice
    probe(s, b"W1", 1, 0.005, 0.002)
    assert not s.planner.probing and s.registry.plan.gen == 1 and s.registry.plan.batches == (40, 20)
    assert refused(s, b"W1", Probe(rank=1, batches=[2, 4], seconds=[0.1, 0.2]))  # after the start


def test_a_probe_of_a_worker_gone_does_not_stand_for_whoever_takes_its_rank(make):
    s = make(num_workers=3, global_batch=60, min_workers=2)
    for r in range(2):
        register(s, b"W%d" % r, "worker", r)
    probe(s, b"W1", 1, 0.005, 0.010, mem_free=200_000, sample_bytes=10_000)  # slow, short of memory
    s._depart(1, "silent")
    register(s, b"NEW", "worker", 1)  # takes rank 1 while worker 0 still probes: it does not probe
    probe(s, b"W0", 0, 0.005, 0.001)
    plan = s.registry.plan
    assert s.planner.control.max_batch[1] == 60 and not s.planner.control.models.measured([1])[0]
    # the newcomer is taken as fast as the typical worker at its batch, not as the one gone
    assert abs(plan.batches[1] - 30) <= 3 and sum(plan.batches) == 60, plan


def test_workers_that_joined_during_the_probe_go_on_when_every_prober_left(make):
    s = make(num_workers=2, global_batch=32, min_workers=1, mode="asp")
    register(s, b"W0", "worker", 0)
    assert s.planner.probing == {0}
    register(s, b"W1", "worker")  # joins while worker 0 probes
    s._depart(0, "silent")  # before its probe: nothing to plan from
    assert not s.planner.probing and s.registry.plan.batches == (0, 32)


def test_a_memory_bound_from_a_probe_holds_inside_the_deadband(make):
    s = make(num_workers=3, global_batch=120, deadband=0.2)
    for r in range(3):
        register(s, b"W%d" % r, "worker", r)
    # equal speeds: the plan stays 40/40/40 by the deadband, but worker 0's memory holds 39
    # 0.8 x 296,250 B free / 3 workers on the host / (2 x 1000 B a sample) -> 39 samples
    probe(s, b"W0", 0, 0.005, 0.001, mem_free=296_250, sample_bytes=1000)
    for r in (1, 2):
        probe(s, b"W%d" % r, r, 0.005, 0.001)
    assert s.planner.control.max_batch[0] == 39
    assert s.registry.plan.batches[0] <= 39 and sum(s.registry.plan.batches) == 120


def test_a_server_that_cannot_restore_its_shard_fails_the_job_at_once(make, tmp_path):
    from omnips.protocol import Error
    from server.service import _restore
    from server.shard import ShardCore

    sent = []
    link = type("Link", (), {"send": lambda self, msg: sent.append(msg),
                             "in_phase": lambda self, phase: contextlib.nullcontext()})()
    core = ShardCore(JobSpec(), 0, 4, 4)
    with pytest.raises(ValueError, match="no checkpoint|cannot read"):
        _restore(core, 0, 0, 4, link, str(tmp_path / "no-such-checkpoint"))
    assert [type(m) for m in sent] == [Error] and sent[0].code == "restore_failed" and not core.initialized
    s = make(num_workers=1)
    s._on_message(b"X", sent[0])  # from a peer that is no server: refused, nothing more
    with pytest.raises(JobFailed, match="server 0 cannot restore its shard"):
        s._on_message(b"S", sent[0])


def test_a_server_registering_while_every_shard_has_one_is_refused_unless_one_missed_two_heartbeats(make):
    s = make(num_workers=1)
    register(s, b"W0", "worker", 0)
    assert s.registry.complete
    register(s, b"S2", "server")  # server 0 is alive: the newcomer is refused, nothing changes
    assert b"S2" not in s.registry.by_peer and [m.peer for m in s.registry.servers] == [b"S"]
    # server 0 last heard from 2.5 heartbeats ago, long before --dead-after (30 s): taken for lost
    # at once (here without a checkpoint, so the job fails with the reason)
    s._heard[b"S"] = s._complete_at = time.monotonic() - 2.5 * s.opts.heartbeat_s
    with pytest.raises(JobFailed, match=r"server 0 at tcp://127.0.0.1:1 silent for 2\.\d s when a new server registered"):
        register(s, b"S3", "server")


def test_a_server_of_another_job_or_a_second_registration_removes_no_silent_server(make):
    s = make(num_workers=1, token="secret")
    register(s, b"W0", "worker", 0, token="secret")
    s._heard[b"S"] = s._complete_at = time.monotonic() - 2.5 * s.opts.heartbeat_s  # would be taken for lost
    register(s, b"S2", "server", token="another")
    register(s, b"S", "server", token="secret")  # server 0's own connection, again
    assert [m.peer for m in s.registry.servers] == [b"S"] and not s.registry.vacant_servers
    assert b"S2" not in s.registry.by_peer


@pytest.mark.parametrize("mode", ["asp", "bsp"])
def test_a_report_of_a_batch_above_the_jobs_largest_is_refused_and_counts_nothing(make, mode):
    s = make(num_workers=2, global_batch=60, mode=mode, batching="uniform", probe=False)
    for rank in range(2):
        register(s, b"W%d" % rank, "worker", rank)
    before = (s.progress.samples, s.progress.workers[0].next_step, s.progress.budget_reached)
    s._on_report(b"W0", Report(rank=0, step=0, batch=61, compute_s=0.03, network_s=0.0, wait_s=0.0, loss=1.0))
    assert (s.progress.samples, s.progress.workers[0].next_step, s.progress.budget_reached) == before
    s._on_report(b"W0", Report(rank=0, step=0, batch=60, compute_s=0.03, network_s=0.0, wait_s=0.0, loss=1.0))
    assert s.progress.samples == 60 and s.progress.workers[0].next_step == 1  # the largest is a batch


def test_a_scheduler_that_sent_nothing_for_longer_than_processes_wait_fails_the_job_saying_it_stalled(make):
    s = make(num_workers=1)  # --heartbeat 1, --dead-after 30: processes give up after 30 s and a heartbeat's grace
    s._next_beat = time.monotonic() - 100  # still forming: processes not yet welcomed wait 30 s, whatever
    s._heartbeat()                         # --dead-after says, and nothing here says when they registered
    register(s, b"W0", "worker", 0)
    assert s.registry.complete
    s._next_beat = time.monotonic() - 29.5  # the last heartbeats left 30.5 s ago: none gave up yet
    s._heartbeat()
    s._next_beat = time.monotonic() - 30.5  # 31.5 s ago: all have
    with pytest.raises(JobFailed, match=r"^the scheduler sent nothing for 32 s \(it was stalled: stopped, or starved of "
                                        r"CPU\), longer than --dead-after \(30 s\), after which the servers "
                                        r"and workers give up on it$"):
        s._heartbeat()


def test_a_heartbeat_asking_for_an_echo_is_echoed_to_a_member_at_once(make, monkeypatch):
    s = make(num_workers=1, global_batch=8)
    sent = []
    monkeypatch.setattr(service.transport, "reply", lambda sock, peer, msg, **kw: sent.append((peer, msg)))
    s._on_message(b"S", Heartbeat())  # a plain one is not answered
    s._on_message(b"S", Heartbeat(echo=7))
    s._on_message(b"X", Heartbeat(echo=8))  # not a member (a server already removed): no answer
    assert sent == [(b"S", Heartbeat(echo=7))]


def test_a_dropped_message_names_its_peer_by_role_rank_and_host(make, caplog):
    s = make(num_workers=2, global_batch=60)
    for r in range(2):
        register(s, b"W%d" % r, "worker", r)
    s._heartbeat()  # nobody is connected: every heartbeat is dropped
    dropped = sorted(r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped heartbeat"))
    assert dropped == [f"dropped heartbeat to {who} on h (pid 0): Host unreachable"
                       for who in ("server 0", "worker 0", "worker 1")], dropped
    s._depart(1, "silent for 5 s")  # and one it no longer counts as a member
    assert "dropped shutdown to worker 1 on h (pid 0): Host unreachable" in caplog.text


def test_a_stop_asked_again_ends_the_job_at_once(make):
    s = make(num_workers=1, global_batch=60)
    s.request_stop("SIGTERM")
    s._stopping(time.monotonic())  # begun: nothing trained yet, so it ends at the next turn
    assert s._ended() and s._stop.detail(0, model=False) == "SIGTERM at step 0: model.pt not written"
    with pytest.raises(KeyboardInterrupt):
        s.request_stop("SIGTERM")


def lost_events(s) -> list[dict]:
    s.run.flush()
    return [e for e in read_events(s.run.path) if e["event"] == "membership" and e["change"] == "lost"]


def test_a_worker_that_fails_says_why_and_the_scheduler_replans_at_once(make, monkeypatch):
    s = make(num_workers=2, global_batch=60, batching="uniform")
    sent = []
    monkeypatch.setattr(service.transport, "reply", lambda sock, peer, msg, **kw: sent.append((peer, msg)))
    for r in range(2):
        register(s, b"W%d" % r, "worker", r)
    before = s.registry.plan
    s._on_message(b"X", Failed(reason="not in the job"))  # a stranger's word changes nothing
    assert s.registry.plan == before and set(s.registry.workers) == {0, 1} and not lost_events(s)
    s._on_message(b"W1", Failed(reason="worker 1 on h: this worker's model differs from the scheduler's"))
    assert set(s.registry.workers) == {0} and s.lost == 1
    assert s.registry.plan.gen == before.gen + 1 and list(s.registry.plan.batches) == [60, 0]
    [lost] = lost_events(s)
    assert lost["rank"] == 1 and lost["reason"] == "failed: worker 1 on h: this worker's model differs from the " \
                                                   "scheduler's"
    assert any(isinstance(m, Plan) and m.departed == [[1, -1]] for peer, m in sent if peer == b"S")


def test_a_silent_worker_is_named_with_the_phase_its_last_heartbeat_told(make):
    s = make(num_workers=2, global_batch=60, batching="uniform")
    for r in range(2):
        register(s, b"W%d" % r, "worker", r)
    s._on_message(b"W1", Heartbeat(phase="building the model"))
    now = time.monotonic()
    s._complete_at = now - 40
    s._heard.update({b"S": now, b"W0": now, b"W1": now - 31})
    s._check_silences(now)
    [lost] = lost_events(s)
    assert lost["rank"] == 1 and lost["reason"] == "silent for 31 s, last heard building the model", lost
