"""A server restored from a checkpoint can refuse a worker's push before the worker has
read the scheduler's rewind (issue 23): the worker waits for the rewind instead of ending.
A real worker meets a stand-in scheduler and server (tests/worker_stand_ins.py) that put
the refusal first."""

import socket

import pytest
import zmq
from worker_stand_ins import JOB, StandInScheduler, StandInServer, WorkerThread, drive, num_params

from omnips.batching import BatchPlan
from omnips.protocol import Failed, Report, Rewind, Shutdown

WAITING = "waiting for the scheduler's rewind"


@pytest.fixture
def stand_ins():
    """(scheduler, server, ctx): the server refuses step 3's push as a shard restored to version 1."""
    ctx = zmq.Context()
    try:
        n = num_params(JOB)
        server = StandInServer(ctx, n, refuse={3: 1})
        yield StandInScheduler(ctx, JOB, [server.endpoint], n), server, ctx
    finally:
        ctx.destroy(linger=0)


def _ended(worker):
    return lambda: not worker.thread.is_alive()


def test_a_push_refused_by_a_restored_shard_before_the_rewind_is_read_waits_for_the_rewind(stand_ins):
    scheduler, server, _ = stand_ins
    worker = WorkerThread(scheduler.endpoint)
    parts = (scheduler, server)
    # the refusal comes first; the rewind only once the worker says it waits for one
    drive(parts, lambda: WAITING in scheduler.phases or _ended(worker)(), "wait for the rewind")
    assert worker.outcome is None, worker.outcome
    scheduler.send(Rewind(steps=[1], positions=[0], plan=BatchPlan(1, (JOB.global_batch,)),
                          servers=[server.endpoint]))
    drive(parts, lambda: any(isinstance(m, Report) and m.done for m in scheduler.heard), "done report")
    scheduler.send(Shutdown(ok=True))
    drive(parts, _ended(worker), "end of the worker")
    assert worker.outcome == 0
    # steps 0-2, the refused push of step 3, then steps 1-5 again on the restored shard
    assert server.pushes == [(0, 0), (1, 1), (2, 2), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    assert not [m for m in scheduler.heard if isinstance(m, Failed)]


def test_without_a_rewind_within_the_server_timeout_the_worker_ends_saying_what_it_waited_for(stand_ins):
    scheduler, server, _ = stand_ins
    worker = WorkerThread(scheduler.endpoint, server_timeout_s=1.0)
    drive((scheduler, server), _ended(worker), "end of the worker")
    text = str(worker.outcome)
    assert text.startswith(f"worker 0 on {socket.gethostname()}: server 0 at {server.endpoint} refused: "
                           "bad_version: push computed on version 3, shard is at 1"), text
    assert text.endswith("but no rewind came from the scheduler within 1 s"), text
    assert "\n" not in text
    failed = [m for m in scheduler.heard if isinstance(m, Failed)]
    assert len(failed) == 1 and "no rewind came" in failed[0].reason


def test_any_other_refusal_ends_the_worker_at_once(stand_ins):
    scheduler, _, ctx = stand_ins
    server = StandInServer(ctx, scheduler.n, refuse={3: 3}, code="bad_rank")
    scheduler.servers = [server.endpoint]
    worker = WorkerThread(scheduler.endpoint)
    drive((scheduler, server), _ended(worker), "end of the worker")
    assert str(worker.outcome).startswith(f"server 0 at {server.endpoint} refused: bad_rank:"), worker.outcome
    assert WAITING not in scheduler.phases

