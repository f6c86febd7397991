"""Fixtures for end-to-end tests (helpers.py holds the cluster plumbing)."""

import pytest
import zmq
from helpers import finish, start_cluster

from omnips import protocol, transport
from omnips.launch import WorkerSpec
from omnips.link import SchedulerLink
from omnips.protocol import Heartbeat


@pytest.fixture
def run_job(tmp_path):
    """run_job(scheduler_args, workers, num_servers=1) -> Run, after the job ended cleanly."""
    def run(scheduler_args, workers=(WorkerSpec(), WorkerSpec()), num_servers=1, name="run", **kw):
        return finish(start_cluster(tmp_path / name, scheduler_args, workers, num_servers, **kw))
    return run


@pytest.fixture
def linked():
    """(link, send, clock, recv): a link with --dead-after 3 and heartbeats every 0.2 s,
    connected to the stand-in scheduler; send(msg) sends it a message from there, recv()
    reads the next one it sent (10 s at most); clock[0] is its time."""
    ctx = zmq.Context()
    try:
        router = transport.socket(ctx, zmq.ROUTER)
        endpoint = transport.bind(router, "127.0.0.1", 0)
        clock = [0.0]
        link = SchedulerLink(ctx, endpoint, dead_after_s=3.0, clock=lambda: clock[0])
        link.heartbeat_s = 0.2
        link.send(Heartbeat())  # the stand-in learns whom to answer
        assert router.poll(10_000), "the link did not connect"
        peer = transport.recv_frames(router)[0].bytes

        def recv():
            assert router.poll(10_000), "nothing came from the link"
            return protocol.decode(transport.recv_frames(router)[1:])

        yield link, lambda msg: transport.send(router, msg, to=peer), clock, recv
    finally:
        ctx.destroy(linger=0)
