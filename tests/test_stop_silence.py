"""A worker that freezes during a stop (preemption), driven through the scheduler's and the
shards' pure cores: it is taken for lost after a few silent seconds (stopping.worker_silence_limit),
not --dead-after, so the others end the step it held and every shard is read at one version."""

import functools

import pytest

from omnips.protocol import Heartbeat, Plan, Pull
from omnips.scheduler.instructions import AskCheckpoint, AskEval
from omnips.server.shard_state import Snapshot

from scheduler_helpers import events, register, scheduler_core, sent, step_report
from shard_helpers import PEERS, SCHED, make_core, push


@pytest.fixture
def make(tmp_path):
    return functools.partial(scheduler_core, tmp_path)


def beats(c, peers, now) -> None:
    for peer in peers:
        c.handle(peer, Heartbeat(), now)


def test_a_worker_silent_during_a_stop_is_lost_so_the_others_end_their_step_before_the_model_is_read(make):
    # worker 1 froze during step 1, perhaps part-way through its push: the shards it reached have
    # applied step 1, the others hold worker 0's push; --dead-after (30 s) is past the stop's deadline
    c = make(num_workers=2, global_batch=60, batching="uniform", probe=False, checkpoint_every=1000)
    for r in range(2):
        register(c, b"W%d" % r, "worker", r)
    for r in range(2):
        c.handle(b"W%d" % r, step_report(r, 0, 30), 1.0)
    c.request_stop("SIGTERM")
    c.tick(1.0)
    stop_plan = c.planner.plan
    assert stop_plan.stop
    for now in (2.0, 4.0, 5.5):
        beats(c, (b"S", b"W0"), now)
        out = c.tick(now, unread=False)
    assert not events(out, "membership")  # 4.5 s: not past the stop's limit, max(3 heartbeats, 20 s / 4)
    out = c.tick(6.5, unread=False)
    [lost] = events(out, "membership")
    assert (lost["rank"], lost["change"], lost["reason"]) == (1, "lost", "silent for 6 s during the stop")
    # the servers wait no more for its step 1: those that held it end the step with worker 0's push
    assert sent(out, b"S", Plan) == [Plan(plan=stop_plan, departed=((1, 0),))]
    assert not c.stop.saving  # worker 0 ends its step first
    c.handle(b"W0", step_report(0, 1, 30), 7.0)
    c.handle(b"W0", step_report(0, 2, 0, done=True), 7.0)
    c.tick(7.0)
    assert c.stop.saving and c.stop.checkpoint_request is not None
    [(_, asked)] = [(r, a) for r, a in c.checkpoints.pending.items() if r == c.stop.checkpoint_request]
    assert asked.step == 2  # the version every shard holds once step 1 ended


@pytest.mark.parametrize("workers", [1, 2])
def test_with_every_worker_silent_during_a_stop_none_is_lost_and_the_model_is_read_half_way(make, workers):
    # none could end the step the others wait in: losing them all would fail the job, unsaved
    c = make(num_workers=workers, global_batch=60, batching="uniform", probe=False)
    for r in range(workers):
        register(c, b"W%d" % r, "worker", r)
    for r in range(workers):
        c.handle(b"W%d" % r, step_report(r, 0, 60 // workers), 1.0)
    c.request_stop("SIGTERM")
    c.tick(1.0)
    for now in (4.0, 8.0):
        beats(c, (b"S",), now)
        assert not events(c.tick(now, unread=False), "membership")
    assert not c.stop.saving
    c.tick(11.5, unread=False)
    assert c.stop.saving and sorted(c.registry.workers) == list(range(workers))


def test_a_worker_frozen_part_way_through_its_push_leaves_every_shard_at_one_version_for_the_stop(make):
    # the order a CI run met: worker 1 froze after its step-1 push reached shard 0, before shard 1.
    # Shard 0 applied step 1 (version 2), shard 1 held worker 0's push (version 1); the stop read
    # them half-way to its deadline at step 1, and its checkpoint at version 1 failed on shard 0
    servers = {b"S": make_core(n=1, init=[0], num_workers=2, global_batch=8),
               b"S1": make_core(n=1, lo=1, init=[0], num_workers=2, global_batch=8)}

    def plans_to_servers(out, now):
        for peer, shard in servers.items():
            for plan in sent(out, peer, Plan):
                shard.set_plan(plan, now)

    c = make(num_workers=2, num_servers=2, global_batch=8, batching="uniform", probe=False)
    register(c, b"S1", "server")
    for r in range(2):
        plans_to_servers(register(c, b"W%d" % r, "worker", r), 0.0)
    gen = c.planner.plan.gen
    assert [s.plan.gen for s in servers.values()] == [gen, gen]
    for shard in servers.values():
        for r in range(2):
            shard.handle(PEERS[r], push(r, 0, [1], gen=gen), 0.0)
    for r in range(2):
        c.handle(b"W%d" % r, step_report(r, 0, 4), 1.0)
    servers[b"S"].handle(PEERS[1], push(1, 1, [1], gen=gen), 1.1)  # then it froze
    for shard in servers.values():
        shard.handle(PEERS[0], push(0, 1, [1], gen=gen), 1.1)
    assert [s.version for s in servers.values()] == [2, 1]
    c.request_stop("SIGTERM")
    plans_to_servers(c.tick(1.2), 1.2)
    for now in (2.0, 4.0, 6.0, 7.0):
        beats(c, (b"S", b"S1", b"W0"), now)
        plans_to_servers(c.tick(now, unread=False), now)
    assert [s.version for s in servers.values()] == [2, 2]  # shard 1 ended step 1 without worker 1
    c.handle(b"W0", step_report(0, 1, 4), 7.1)
    c.handle(b"W0", step_report(0, 2, 0, done=True), 7.1)
    out = c.tick(7.2)
    [read] = [i for i in out if isinstance(i, AskEval)]  # model.pt: the shards as they hold them now
    [ask] = [i.msg for i in out if isinstance(i, AskCheckpoint)]
    assert read.at is None and ask.at == 2
    for shard in servers.values():  # each reads and writes version 2 (at 1, shard 0 refused: version_passed)
        [params] = shard.handle(SCHED, Pull(request=read.request, at=read.at), 7.3)
        assert params.msg.version == 2
        [snapshot] = shard.handle(SCHED, ask, 7.3)
        assert isinstance(snapshot, Snapshot) and snapshot.step == 2
