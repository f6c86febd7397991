"""scheduler.registry.Registry driven directly: rendezvous, --min-workers, vacant ranks, joins."""

from omnips.batching import BatchPlan
from omnips.job import JobSpec
from omnips.protocol import Ack, Error, Register, Welcome
from omnips.scheduler.registry import Registry


def registry(**job):
    spec = JobSpec(**{"num_workers": 3, "global_batch": 12, **job})
    spec.check()
    return Registry(spec, num_params=10, num_trained=10, total_steps=5, dead_after_s=3.0)


def server(reg, peer=b"s0"):
    return reg.register(peer, Register(role="server", host="h", endpoint="tcp://h:1"))


def worker(reg, peer, rank=-1, capacity=1.0):
    return reg.register(peer, Register(role="worker", host="h", rank=rank, capacity=capacity))


def test_the_job_starts_with_every_worker_by_default():
    reg = registry()
    server(reg)
    assert [type(m) for _, m in worker(reg, b"a")] == [Ack]
    worker(reg, b"b")
    assert not reg.complete
    out = worker(reg, b"c")
    assert [type(m) for _, m in out] == [Ack]  # the scheduler welcomes them with the first plan
    assert reg.complete and sorted(reg.workers) == [0, 1, 2] and reg.static_batches([0, 1, 2]) == (4, 4, 4)


def test_min_workers_starts_early_with_the_other_ranks_vacant():
    reg = registry(min_workers=2)
    worker(reg, b"a", rank=2)
    worker(reg, b"b")
    assert not reg.complete  # no server yet
    server(reg)
    assert reg.complete and sorted(reg.workers) == [0, 2]
    assert reg.static_batches(sorted(reg.workers)) == (6, 0, 6) and reg.vacant == [1]
    plan = BatchPlan(0, (6, 0, 6))
    assert all(reg.worker_welcome(m, plan).worker.join_gen == -1 for m in reg.workers.values())


def test_a_late_worker_takes_a_vacant_rank_and_waits_for_its_plan():
    reg = registry(min_workers=1)
    server(reg)
    worker(reg, b"a")
    assert [type(m) for _, m in worker(reg, b"late")] == [Ack]  # the scheduler plans its share, then welcomes
    assert [m.rank for m in reg.joined] == [1] and sorted(reg.workers) == [0, 1]
    assert [type(m) for _, m in worker(reg, b"asks", rank=2)] == [Ack] and reg.vacant == []
    refused = worker(reg, b"one-too-many")
    assert isinstance(refused[0][1], Error) and refused[0][1].code == "cluster_full"
    assert b"one-too-many" not in reg.by_peer


def test_a_departed_rank_is_vacant_for_the_next_worker():
    reg = registry()
    server(reg)
    for peer in (b"a", b"b", b"c"):
        worker(reg, peer)
    gone = reg.depart(1)
    assert gone.peer == b"b" and b"b" not in reg.by_peer and reg.vacant == [1]
    taken = worker(reg, b"d", rank=2)
    assert taken[0][1].code == "rank_taken"
    worker(reg, b"d")
    assert reg.workers[1].peer == b"d" and reg.static_batches([0, 1, 2]) == (4, 4, 4)


def test_static_batches_split_among_the_present_by_capacity():
    reg = registry(batching="static")
    server(reg)
    for peer, cap in ((b"a", 1.0), (b"b", 2.0), (b"c", 3.0)):
        worker(reg, peer, capacity=cap)
    assert reg.static_batches(sorted(reg.workers)) == (2, 4, 6)
    reg.depart(2)
    assert reg.static_batches([0, 1]) == (4, 8, 0)


def test_a_joiners_welcome_says_where_it_starts():
    reg = registry(min_workers=2)
    server(reg)
    worker(reg, b"a")
    worker(reg, b"b")
    worker(reg, b"c")
    w = reg.worker_welcome(reg.joined[0], BatchPlan(3, (4, 4, 4)), join_gen=3, start_step=17)
    assert w.rank == 2 and (w.worker.join_gen, w.worker.step, w.worker.plan.gen) == (3, 17, 3)


def test_workers_share_the_memory_of_their_host_and_device():
    """A GPU's memory is split among the workers on it, the host's RAM among those on its CPU."""
    reg = registry(num_workers=5, global_batch=20)
    server(reg)
    for peer, host, device in ((b"a", "h", "cuda:0"), (b"b", "h", "cuda:0"), (b"c", "h", "cuda:1"),
                               (b"d", "h", "cpu"), (b"e", "g", "cuda:0")):
        reg.register(peer, Register(role="worker", host=host, device=device))
    assert [reg.sharing(rank) for rank in range(5)] == [2, 2, 1, 1, 1]


def test_servers_get_the_ranks_they_ask_for_whatever_order_they_register_in():
    reg = registry(num_servers=3)
    reg.register(b"s2", Register(role="server", host="h", endpoint="tcp://h:2", rank=2))
    reg.register(b"any", Register(role="server", host="h", endpoint="tcp://h:9"))
    refused = reg.register(b"dup", Register(role="server", host="h", endpoint="tcp://h:3", rank=2))
    assert [m.code for _, m in refused] == ["rank_taken"]
    out = reg.register(b"s0", Register(role="server", host="h", endpoint="tcp://h:0", rank=0))
    welcomes = {to: m.rank for to, m in out if isinstance(m, Welcome)}
    assert welcomes == {b"s2": 2, b"any": 1, b"s0": 0}
    assert [m.peer for m in reg.servers] == [b"s0", b"any", b"s2"] and reg.by_peer[b"any"].rank == 1


def test_a_workers_welcome_counts_the_jobs_workers_on_its_host():
    reg = registry()
    server(reg)
    reg.register(b"a", Register(role="worker", host="h"))
    reg.register(b"b", Register(role="worker", host="g"))
    reg.register(b"c", Register(role="worker", host="h"))
    plan = BatchPlan(0, reg.static_batches(sorted(reg.workers)))
    counts = {m.peer: reg.worker_welcome(m, plan).worker.host_workers for m in reg.workers.values()}
    assert counts == {b"a": 2, b"b": 1, b"c": 2}
