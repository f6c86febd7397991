"""A welcome comes over the network: a rank, shard ranges or a plan that do not fit the job
are refused where the welcome is decoded, in one line naming the field, before a worker or
a server takes a seat from it (omnips/cluster.py, Welcome.check)."""

import msgpack
import pytest

from omnips.batching import BatchPlan
from omnips.cluster import ClusterMap, ServerStart, WorkerStart
from omnips.codec import decode, encode
from omnips.job import JobSpec
from omnips.link import LinkError
from omnips.protocol import ProtocolError, Welcome

JOB = JobSpec(num_workers=2, num_servers=2)
CLUSTER = ClusterMap(num_params=10, ranges=((0, 5), (5, 10)), servers=("tcp://a:1", "tcp://b:1"), dead_after_s=30.0,
                     heartbeat_s=1.0)
WORKER = WorkerStart(plan=BatchPlan(0, (32, 32)), total_steps=100)


def header(rank: int, **start) -> dict:
    return msgpack.unpackb(encode(Welcome(rank=rank, job=JOB, cluster=CLUSTER, **start))[0], raw=False)


def refused(h: dict) -> ProtocolError:
    with pytest.raises(ProtocolError) as exc:
        decode([msgpack.packb(h)])
    assert exc.value.code == "bad_field" and len(exc.value.text) < 300  # the line does not repeat what was sent
    return exc.value


def test_the_schedulers_own_welcomes_are_taken_as_they_were_sent():
    for rank in (0, 1):
        for start in ({"worker": WORKER}, {"server": ServerStart(num_trained=8, checkpoint_dir="/ckpt")}):
            got = decode([msgpack.packb(header(rank, **start))])
            assert (got.rank, got.job, got.cluster) == (rank, JOB, CLUSTER)
            assert (got.worker, got.server) == (start.get("worker"), start.get("server"))


@pytest.mark.parametrize("rank", [-1, 2, 2 ** 63])
def test_a_rank_outside_the_job_is_refused(rank):
    h = header(0, worker=WORKER)
    h["rank"] = rank
    assert refused(h).text == f"welcome: rank {rank} in a job of 2 workers"


@pytest.mark.parametrize("ranges", [[[0, 5]], [[5, 10], [0, 5]], [[0, 4], [4, 10]], [[None, 5], [5, 10]],
                                    [[0, 5], [5, 10 ** 12]], [[0, 5], [5, 10], [10, 10]], "x" * 10_000])
def test_ranges_that_are_not_the_jobs_shards_are_refused(ranges):
    h = header(0, worker=WORKER)
    h["cluster"]["ranges"] = ranges
    assert "ranges" in refused(h).text


def test_a_plan_for_another_number_of_workers_is_refused():
    h = header(0, worker=WORKER)
    h["worker"]["plan"]["batches"] = [16, 16, 32]
    assert refused(h).text == "welcome: worker.plan: 3 batches in a job of 2 workers"


def test_a_welcome_starts_one_role():
    h = header(0, worker=WORKER)
    del h["worker"]
    assert refused(h).text == "welcome: a welcome starts either a server or a worker"
    h = header(0, server=ServerStart(num_trained=11, checkpoint_dir=""))
    assert refused(h).text == "welcome: server.num_trained 11 exceeds cluster.num_params 10"


def test_a_malformed_welcome_ends_the_wait_for_it_at_once(linked):
    """Without a welcome the process cannot start: one that does not fit its job is not
    dropped and waited past, as other bad messages from the scheduler are."""
    link, send, _, _ = linked
    send(Welcome(rank=2, job=JOB, cluster=CLUSTER, worker=WORKER))
    assert link.sock.poll(10_000)
    with pytest.raises(LinkError, match=r"^malformed welcome from the scheduler: welcome: rank 2 in a job of 2 workers$"):
        link.receive()
