"""Pushes in parts: the worker's bucket plan (worker/buckets.py) and the server's
assembly (server/assembly.py, through ShardCore), driven directly."""

import threading
from dataclasses import replace

import numpy as np
import pytest
import zmq
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips import codec, data, models, protocol
from omnips import servers as servers_module
from omnips.batching import BatchPlan
from omnips.flat import FlatModel
from omnips.protocol import Params, Push
from omnips.servers import ServerError, ServerGroup
from omnips.sharding import shard_ranges
from omnips.wire import WireDtype
from omnips.server.assembly import Assembler, PartRefused
from omnips.worker.buckets import BucketPlan, bucket_floor, bucket_values
from omnips.worker.pushing import Pusher
from omnips.worker.trainer import Trainer

from shard_helpers import PEERS, assert_refused, make_core, parts_of, push


@st.composite
def layouts(draw):
    sizes = draw(st.lists(st.integers(1, 50), min_size=1, max_size=12))
    spans, pos = [], 0
    for n in sizes:
        spans.append((pos, pos + n))
        pos += n
    size = pos + draw(st.integers(0, 20))  # buffers' slots after the trained values
    shards = draw(st.integers(1, min(4, size)))
    return spans, size, [tuple(r) for r in shard_ranges(size, shards)], draw(st.integers(0, 120))


@given(layouts(), st.randoms(use_true_random=False))
@settings(max_examples=300, deadline=None)
def test_buckets_tile_the_vector_and_each_leaves_once_its_parameters_are_done(layout, rnd):
    spans, size, ranges, bucket_values = layout
    plan = BucketPlan(spans, size, ranges, bucket_values)
    bks = plan.buckets
    assert bks[0].lo == 0 and bks[-1].hi == size and all(a.hi == b.lo for a, b in zip(bks, bks[1:]))
    for bk in bks:
        lo, hi = ranges[bk.shard]
        assert lo <= bk.lo < bk.hi <= hi  # inside one shard: a push goes to one server
    trained = spans[-1][1]
    edges = {lo for lo, _ in ranges} | {hi for _, hi in spans} | {size}
    assert all(bk.hi in edges for bk in bks)  # cut where a parameter or a shard ends
    if bucket_values == 0:
        assert [(bk.lo, bk.hi) for bk in bks] == ranges
    else:
        assert all(bk.hi <= trained or bk.lo >= trained for bk in bks)  # buffers' slots go apart
    order = list(range(len(spans)))
    for _ in range(2):  # a second step counts anew
        plan.start()
        rnd.shuffle(order)
        done = []
        for i in order:
            ready = plan.ready(i)
            for b in ready:  # complete: every parameter in it is done
                assert all(j in order[:order.index(i) + 1] for j, (lo, hi) in enumerate(spans)
                           if lo < bks[b].hi and bks[b].lo < hi)
                plan.sent[b] = True
            done += ready
        assert sorted(done) == [b for b, bk in enumerate(bks) if bk.lo < trained]  # each once
        assert plan.unsent() == [b for b, bk in enumerate(bks) if bk.lo >= trained]


@pytest.mark.parametrize("spans, shards", [(1, 1), (1, 3), (3, 2), (1000, 1)])
def test_no_shard_is_cut_into_more_than_max_parts_whatever_the_bucket_size(spans, shards):
    # 5000 parameters of `spans` values each, buckets asked of 1 value: one per parameter without the floor
    size = 5000 * spans + 7
    ranges = [tuple(r) for r in shard_ranges(size, shards)]
    plan = BucketPlan([(i * spans, (i + 1) * spans) for i in range(5000)], size, ranges, 1)
    assert plan.bucket_values == bucket_floor(ranges) > 1
    per_shard = [sum(bk.shard == s for bk in plan.buckets) for s in range(shards)]
    assert max(per_shard) <= protocol.MAX_PARTS
    assert plan.buckets[0].lo == 0 and plan.buckets[-1].hi == size  # still a tiling (the property test above)
    # no coarser than it must (the buffers' 7 slots go apart, in one bucket)
    assert all(bk.hi - bk.lo < plan.bucket_values + spans for bk in plan.buckets if bk.hi <= 5000 * spans)


def test_a_bucket_size_in_bytes_is_values_rounded_up():
    assert [bucket_values(b) for b in (0, 1, 3, 4, 5, 4 << 20)] == [0, 1, 1, 1, 2, 1 << 20]  # only 0 turns them off


def test_a_step_computed_again_keeps_what_was_sent():
    plan = BucketPlan([(0, 4), (4, 8)], 8, [(0, 8)], 4)
    plan.start()
    assert plan.ready(1) == [1]
    plan.sent[1] = True
    plan.again()
    assert plan.ready(1) == [] and plan.ready(0) == [0]
    assert plan.completes_shard(0) and not plan.completes_shard(1)


def joined(segments, n):
    out = np.full(n, np.nan, dtype=np.float32)
    for lo, values in segments:
        out[lo:lo + values.size] = values
    return out


@given(st.integers(1, 64).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(1, n - 1) if n > 1
                                                                          else st.nothing()))),
       st.randoms(use_true_random=False))
def test_parts_in_any_order_join_to_the_pushed_values(shape, rnd):
    n, cuts = shape
    values = np.arange(n, dtype=np.float32) * 0.5
    parts = parts_of(values, sorted(cuts))
    rnd.shuffle(parts)
    asm = Assembler(n, max_open=2)
    out = [asm.feed(b"w", p) for p in parts]
    assert out[:-1] == [None] * (len(parts) - 1) and asm.open == 0 and asm.joined == 1
    whole = out[-1].push
    assert (whole.whole, whole.offset, whole.rank, whole.batch) == (0, 0, 0, 4)
    np.testing.assert_array_equal(joined(out[-1].segments, n), values)
    assert all(np.shares_memory(v, p.data) for (_, v), p in zip(out[-1].segments, parts))  # kept, not copied


@given(st.integers(2, 40).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(1, n - 1), min_size=1))),
       st.randoms(use_true_random=False), st.integers(0, 39), st.integers(1, 40))
def test_a_part_overlapping_any_part_held_is_refused_whatever_the_order(shape, rnd, lo, size):
    """The overlap check (by bisection over the parts held) against every part held in turn."""
    n, cuts = shape
    parts = parts_of(np.arange(n, dtype=np.float32), sorted(cuts))
    rnd.shuffle(parts)
    asm = Assembler(n, max_open=2)
    for p in parts[:-1]:
        asm.feed(b"w", p)
    held = parts[:-1]
    lo, hi = min(lo, n - 1), min(lo + size, n)
    probe = Push(rank=0, step=0, version=0, batch=4, gen=0, data=np.zeros(hi - lo, dtype=np.float32), offset=lo, whole=n)
    overlaps = any(lo < p.offset + p.data.size and p.offset < hi for p in held)
    try:
        asm.feed(b"w", probe)
        refused = False
    except PartRefused:
        refused = True
    assert refused == overlaps


def test_parts_that_do_not_fit_are_refused_and_change_nothing():
    values = np.arange(8, dtype=np.float32)
    asm = Assembler(8, max_open=1)
    first = parts_of(values, [4])[0]
    assert asm.feed(b"w", first) is None
    cases = [(first, "bad_part"),  # the same values again
             (Push(rank=0, step=0, version=0, batch=4, gen=0, data=values[2:6], offset=2, whole=8), "bad_part"),
             (parts_of(values, [4], rank=1)[1], "bad_part"),  # another worker's, on this connection
             (parts_of(values, [4], batch=5)[1], "bad_part"),
             (Push(rank=0, step=0, version=0, batch=4, gen=0, data=values[4:], offset=4, whole=9), "bad_length")]
    for part, code in cases:
        with pytest.raises(PartRefused) as refused:
            asm.feed(b"w", part)
        assert refused.value.code == code
    with pytest.raises(PartRefused, match="busy"):  # one push in assembly at most, here
        asm.feed(b"other", parts_of(values, [4])[0])
    whole = asm.feed(b"w", parts_of(values, [4])[1])  # the open push was left as it was
    np.testing.assert_array_equal(joined(whole.segments, 8), values)


def test_a_push_in_more_than_max_parts_is_refused_and_changes_nothing():
    n = protocol.MAX_PARTS + 1
    values = np.arange(n, dtype=np.float32)
    asm = Assembler(n, max_open=1)
    parts = parts_of(values, list(range(1, n)))  # one value each
    assert [asm.feed(b"w", p) for p in parts[:-1]] == [None] * protocol.MAX_PARTS
    with pytest.raises(PartRefused, match=f"more than {protocol.MAX_PARTS} parts") as refused:
        asm.feed(b"w", parts[-1])
    assert refused.value.code == "bad_part" and asm.open == 1 and asm.joined == 0


def test_a_dropped_gradient_or_a_departed_worker_voids_the_parts():
    values = np.arange(8, dtype=np.float32)
    asm = Assembler(8, max_open=4)
    asm.feed(b"w", parts_of(values, [4])[0])
    asm.void(b"w", Push(rank=0, step=1, version=0, batch=0, gen=0, data=values[:0]))  # another step: kept
    assert asm.open == 1
    asm.void(b"w", Push(rank=0, step=0, version=0, batch=0, gen=0, data=values[:0]))
    assert asm.open == 0
    asm.feed(b"w", parts_of(values, [4], rank=2)[0])
    asm.feed(b"v", parts_of(values, [4], rank=1)[0])
    asm.forget(2)
    assert asm.open == 1
    assert asm.feed(b"v", parts_of(values, [4], rank=1)[1]) is not None


def test_a_bsp_step_from_parts_is_the_step_from_whole_pushes():
    grads = [np.array([1, -2, 3, 0.5, 4, -1], dtype=np.float32) * (r + 1) for r in range(3)]
    whole, parted = make_core(init=np.ones(6)), make_core(init=np.ones(6))
    for r, g in enumerate(grads):
        out = whole.handle(PEERS[r], push(r, 0, g, batch=r + 2), 1.0)
        for part in parts_of(g, [1, 4], rank=r, batch=r + 2):
            out2 = parted.handle(PEERS[r], part, 1.0)
        assert [type(o.msg) for o in out] == [type(o.msg) for o in out2]
    assert isinstance(out2[0].msg, Params) and parted.version == whole.version == 1
    np.testing.assert_array_equal(parted.values, whole.values)
    assert parted.parts_joined == 3


def test_a_core_refuses_a_bad_part_without_a_change_and_a_dropped_push_voids_its_parts():
    core = make_core(init=np.ones(6))
    g = np.arange(6, dtype=np.float32)
    assert core.handle(PEERS[0], parts_of(g, [3])[0], 1.0) == []
    assert_refused(core, PEERS[0], parts_of(g, [3])[0], "bad_part")
    assert_refused(core, PEERS[0], Push(rank=0, step=0, version=0, batch=4, gen=0, data=g[:3], offset=0, whole=7),
                   "bad_length")
    assert core.handle(PEERS[0], push(0, 0, [], batch=0), 1.0) == []  # dropped: waits at the barrier
    assert 0 in core.barrier.pending and core._parts.open == 0
    assert_refused(core, PEERS[0], parts_of(g, [3])[1], "duplicate")  # the rest of the voided push
    assert core._parts.open == 0
    for r in (1, 2):
        core.handle(PEERS[r], push(r, 0, g), 1.0)
    assert core.version == 1
    assert core.handle(PEERS[0], parts_of(g, [3], step=1)[0], 1.0) == []  # a later step replaces it
    out = core.handle(PEERS[0], parts_of(g, [3], step=1)[1], 1.0)
    assert core._parts.open == 0 and core.parts_joined == 1 and 0 in core.barrier.pending, out


def test_a_refused_whole_push_leaves_the_parts_of_its_step_being_assembled():
    core = make_core(init=np.ones(6))
    g = np.arange(6, dtype=np.float32)
    first, rest = parts_of(g, [3])
    assert core.handle(PEERS[0], first, 1.0) == []
    assert_refused(core, PEERS[0], push(0, 0, [1, 1]), "bad_length")
    assert_refused(core, PEERS[0], push(0, 0, [1, np.nan, 1, 1, 1, 1]), "non_finite")
    assert core._parts.open == 1
    assert core.handle(PEERS[0], rest, 1.0) == [] and core.parts_joined == 1 and 0 in core.barrier.pending


@pytest.mark.parametrize("peer, part, code", [
    (b"evil", parts_of(np.ones(6, np.float32), [3], rank=7)[0], "bad_rank"),
    (b"evil", parts_of(np.ones(6, np.float32), [3], rank=0)[0], "rank_taken"),  # bound by its init
    (PEERS[1], parts_of(np.ones(6, np.float32), [3], rank=1, step=5)[0], "bad_step"),
    (PEERS[1], replace(parts_of(np.ones(6, np.float32), [3], rank=1)[0], version=9), "bad_version"),
    (PEERS[1], parts_of(np.ones(6, np.float16), [3], rank=1)[0], "bad_dtype"),
])
def test_a_part_that_fails_the_push_checks_is_refused_before_it_is_assembled(peer, part, code):
    core = make_core(init=np.ones(6))
    for i in range(2 * 3):  # as many as the pushes the core assembles at once: none takes a place
        assert_refused(core, peer + bytes([i]) if peer == b"evil" else peer, part, code)
    assert core._parts.open == 0
    g = np.arange(6, dtype=np.float32)
    for r in range(3):
        for p in parts_of(g, [3], rank=r):
            out = core.handle(PEERS[r], p, 1.0)
    assert core.version == 1 and len(out) == 3 and core.parts_joined == 3


def test_a_part_before_init_is_refused():
    core = make_core()
    assert_refused(core, PEERS[0], parts_of(np.ones(6, np.float32), [3])[0], "not_ready")
    assert core._parts.open == 0


def test_parts_are_checked_finite_as_they_come_and_a_non_finite_one_fails_the_push():
    values = np.arange(8, dtype=np.float32)
    checking, plain = Assembler(8, max_open=1, check=True), Assembler(8, max_open=1)
    assert [checking.feed(b"w", p) for p in parts_of(values, [3])][-1].finite
    assert not [plain.feed(b"w", p) for p in parts_of(values, [3])][-1].finite  # unchecked: the core checks
    bad = values.copy()
    bad[5] = np.inf
    assert not [checking.feed(b"w", p) for p in parts_of(bad, [3])][-1].finite
    # finite values whose sum of squares overflows float32: refused whole, so refused in parts too
    huge = np.full(8, 1.5e19, dtype=np.float32)
    assert not [checking.feed(b"w", p) for p in parts_of(huge, [4])][-1].finite
    assert_refused(make_core(n=8, init=np.ones(8)), PEERS[0], push(0, 0, huge), "non_finite")
    core = make_core(n=8, init=np.ones(8))
    assert core.handle(PEERS[0], parts_of(bad, [3])[1], 1.0) == []  # the non-finite part first: joined anyway
    assert_refused(core, PEERS[0], parts_of(bad, [3])[0], "non_finite")  # the whole push is refused
    assert core.version == 0 and not core.barrier.pending and core._parts.open == 0
    np.testing.assert_array_equal(core.values, np.ones(8))


# -- the worker's side: buckets leave while backward runs --------------------------
class _Servers:
    """Records what a Pusher sends, with a copy of the values as they were then."""

    def __init__(self, ranges):
        self.ranges, self.sent, self.computing, self.waited, self.completed = ranges, [], True, [], []

    def wait_for(self, lo, hi):
        self.waited.append((lo, hi))

    def complete(self):
        self.completed.append(len(self.sent))  # how many buckets had left by then

    def push(self, s, lo, hi, head, track=False):
        self.sent.append((s, lo, hi, head.batch, head.data[lo:hi].copy() if head.batch else None, self.computing))


def _pusher(train, bucket_values, poison_param=None, max_batch=0, poison_value=np.nan, wire="float32"):
    flat = FlatModel(models.build("mlp", {}, train, seed=4))
    if poison_param is not None:  # runs before the pusher's hook on that parameter
        def poison(p):
            p.grad.view(-1)[0] = poison_value
        flat.trained[poison_param].register_post_accumulate_grad_hook(poison)
    ranges = shard_ranges(flat.size, 2)
    pusher = Pusher(flat, ranges, bucket_values, live=True, wire=WireDtype(wire))
    servers = _Servers(ranges)
    trainer = Trainer(flat, data.Batcher(train), max_batch=max_batch)
    trainer.on_final_pass, trainer.on_retry = pusher.final_pass, pusher.settle
    pusher.begin(servers, rank=1, step=3, batch=40, gen=0)
    trainer.compute(np.arange(40))
    servers.computing = False
    return pusher, servers, flat


@pytest.fixture(scope="module")
def train():
    return data.load("digits", {})[0]


@pytest.mark.parametrize("max_batch", [0, 16])  # in one pass, or in chunks: only the last one sends
def test_buckets_leave_during_backward_and_together_are_the_gradient(train, max_batch):
    pusher, servers, flat = _pusher(train, bucket_values=1024, max_batch=max_batch)
    during = len(servers.sent)
    assert pusher.finish()
    assert 0 < during < len(servers.sent)  # some left while backward ran, the rest after
    early = [lo for _, lo, *_ in servers.sent[:during]]
    assert early == sorted(early, reverse=True)  # backward's order: the last layers' buckets first
    got = np.full(flat.size, np.nan, dtype=np.float32)
    for _, lo, hi, batch, values, _ in servers.sent:
        assert batch == 40 and np.isnan(got[lo:hi]).all()  # each value sent once
        got[lo:hi] = values
    reference = Trainer(FlatModel(models.build("mlp", {}, train, seed=4)), data.Batcher(train))
    reference.compute(np.arange(40))
    np.testing.assert_allclose(got, reference.flat.grads, rtol=1e-5, atol=1e-7)
    for s in range(len(servers.ranges)):  # no shard was complete before backward ended
        assert any(not c for sh, *_, c in servers.sent if sh == s)
    # each layer's forward first waited for its own values of the last reply, first layers first
    layers = [(w.weight, w.bias) for w in flat.module if isinstance(w, torch.nn.Linear)]
    want = [(flat.places[id(w)][0], flat.places[id(b)][1]) for w, b in layers]
    assert servers.waited[:len(want)] == want and pusher._head.reply_part == 1024
    assert servers.completed == [0]  # the rest of the last reply was read once, before any bucket left


class _Abandoned(Exception):
    pass


def test_a_step_abandoned_inside_its_backward_leaves_the_next_step_disarmed(train):
    # a rewind may end a step inside its backward: the next step's first chunk (not its
    # last) must push nothing, or a partial gradient would go out as the step's
    flat = FlatModel(models.build("mlp", {}, train, seed=4))
    ranges = shard_ranges(flat.size, 2)
    pusher, servers = Pusher(flat, ranges, 1024, live=True), _Servers(ranges)
    trainer = Trainer(flat, data.Batcher(train), max_batch=16)
    trainer.on_final_pass, trainer.on_retry = pusher.final_pass, pusher.settle
    passes = []

    def abandon(_p):
        passes.append(1)
        if len(passes) == 3:  # the last of 40 samples in chunks of 16: the armed backward
            raise _Abandoned
    flat.trained[0].register_post_accumulate_grad_hook(abandon)  # the first layer: backward's last
    pusher.begin(servers, rank=1, step=3, batch=40, gen=0)
    with pytest.raises(_Abandoned):
        trainer.compute(np.arange(40))
    assert servers.sent  # buckets had left when the step was abandoned
    servers.sent.clear()
    pusher.begin(servers, rank=1, step=4, batch=40, gen=0)
    trainer.compute(np.arange(40))
    assert pusher.finish()
    for _, lo, hi, _, values, _ in servers.sent:
        np.testing.assert_array_equal(values, flat.grads[lo:hi])  # the whole step's, not a chunk's


def test_a_bucket_size_below_the_floor_is_raised_with_a_warning(train, caplog):
    pusher, servers, flat = _pusher(train, bucket_values=1)
    floor = bucket_floor(servers.ranges)
    assert floor > 1 and pusher._head.reply_part == pusher.plan.bucket_values == floor
    assert f"buckets of {floor} values instead of the 1 asked for" in caplog.text
    assert pusher.finish()
    assert max(sum(sh == s for sh, *_ in servers.sent) for s in range(2)) <= protocol.MAX_PARTS


@pytest.mark.parametrize("value, wire", [(np.nan, "float32"), (1e5, "float16")])  # float16 ends at 65504
def test_a_gradient_found_not_finite_midway_stops_the_buckets_and_is_dropped(train, value, wire):
    pusher, servers, flat = _pusher(train, bucket_values=1024, poison_param=2, poison_value=value, wire=wire)
    before = len(servers.sent)
    assert before > 0  # the last layers' buckets had left
    assert not pusher.finish() and len(servers.sent) == before  # nothing more
    pusher.drop()
    assert [(s, batch) for s, _, _, batch, _, _ in servers.sent[before:]] == [(0, 0), (1, 0)]


def test_a_gradient_beyond_float16_is_finite_on_a_wider_wire(train):
    for wire in ("float32", "bfloat16"):  # bfloat16 keeps float32's range
        pusher, servers, _ = _pusher(train, bucket_values=1024, poison_param=2, poison_value=1e5, wire=wire)
        assert pusher.finish() and all(batch == 40 for _, _, _, batch, _, _ in servers.sent), wire


# -- the worker's side: a reply read in parts --------------------------------------
@pytest.fixture
def group():
    """A ServerGroup on two in-process ROUTERs standing in for shard servers of 8 and 4 values."""
    ctx = zmq.Context()
    routers = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    endpoints = [f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}" for r in routers]
    g = ServerGroup(ctx, endpoints, [(0, 8), (8, 12)], timeout_s=0.5)
    try:
        yield g, routers
    finally:
        ctx.destroy(linger=0)


def _answer(router, msgs, peer=None):
    peer = peer or router.recv_multipart()[0]
    for m in msgs:
        router.send_multipart([peer, *codec.encode(m)])
    return peer


def _params(values, offset=0, whole=0, step=5, version=6, plan=None):
    return Params(step=step, version=version, held_s=0.0, plan=plan, data=np.asarray(values, dtype=np.float32),
                  offset=offset, whole=whole)


def _push_both(g):
    for s, (lo, hi) in enumerate(g.ranges):
        g.push(s, lo, hi, Push(rank=0, step=5, version=0, batch=1, gen=0, data=np.ones(12, dtype=np.float32)))


def test_a_reply_in_parts_is_read_as_far_as_the_next_forward_needs(group):
    g, routers = group
    into = np.zeros(12, dtype=np.float32)
    _push_both(g)
    peer = _answer(routers[0], [_params([1, 2, 3], 0, 8)])  # the rest of shard 0 comes later
    _answer(routers[1], [_params([9, 10, 11, 12])])
    ex = g.collect(5, into, early=True)
    assert ex.versions == [6, 6] and into.tolist() == [1, 2, 3, 0, 0, 0, 0, 0, 9, 10, 11, 12]
    g.wait_for(0, 3)
    g.wait_for(8, 12)  # what has arrived: no wait
    with pytest.raises(ServerError, match="no answer"):
        g.wait_for(2, 5)  # values 3 and 4 have not come
    _answer(routers[0], [_params([4, 5], 3, 8), _params([6, 7, 8], 5, 8)], peer)
    g.wait_for(2, 5)
    g.complete()
    assert into.tolist() == list(range(1, 13))


def test_a_worker_reads_its_last_reply_whole_before_it_pushes_again(group, monkeypatch):
    # parts no forward pass waits for (an unused parameter's) are read before the next push:
    # a server refuses a push from a peer whose last reply it still holds queued
    g, routers = group
    seen_at_send, send = [], servers_module.transport.send
    monkeypatch.setattr(servers_module.transport, "send",
                        lambda sock, msg, **kw: seen_at_send.append(into.copy()) or send(sock, msg, **kw))
    into = np.zeros(12, dtype=np.float32)
    _push_both(g)
    peer = _answer(routers[0], [_params([1, 2, 3], 0, 8)])
    _answer(routers[1], [_params([9, 10, 11, 12])])
    g.collect(5, into, early=True)
    assert into[3:8].tolist() == [0] * 5
    _answer(routers[0], [_params([4, 5, 6, 7, 8], 3, 8)], peer)  # no layer's forward pass waited for it
    g.push(1, 8, 12, Push(rank=0, step=6, version=0, batch=1, gen=0, data=np.ones(12, dtype=np.float32)))
    assert seen_at_send[-1].tolist() == list(range(1, 13))  # read whole before the push left
    assert routers[1].poll(5000) and codec.decode(routers[1].recv_multipart()[1:]).step == 6


@pytest.mark.parametrize("bad, text", [([_params([1, 2], 0, 8), _params([5], 4, 8)], "where 2 of 8 were due"),
                                       ([_params([1, 2], 0, 8), _params(np.arange(8))], "broke off a reply"),
                                       ([_params([1, 2], 0, 9)], "where 0 of 8 were due"),
                                       ([_params([1, 2], 0, 8), _params(np.arange(6), 2, 8, version=2)],
                                        "sent a part at version 2 in a reply at 6")])
def test_a_reply_in_parts_out_of_order_or_broken_off_is_an_error(group, bad, text):
    g, routers = group
    _push_both(g)
    _answer(routers[1], [_params([9, 10, 11, 12])])
    _answer(routers[0], bad)
    with pytest.raises(ServerError, match=text):
        g.collect(5, np.zeros(12, dtype=np.float32))


def test_a_shards_version_going_back_is_an_error(group):
    g, routers = group
    into = np.zeros(12, dtype=np.float32)
    _push_both(g)
    peers = [_answer(r, [_params(np.arange(8 - 4 * s))]) for s, r in enumerate(routers)]
    assert g.collect(5, into).versions == [6, 6]
    _push_both(g)
    _answer(routers[0], [_params(np.arange(8), version=7)], peers[0])
    _answer(routers[1], [_params(np.arange(4), version=3)], peers[1])
    with pytest.raises(ServerError, match="server 1 .* answered at version 3 after 6"):
        g.collect(5, into)


def test_a_refused_first_part_opens_no_reply(group):
    g, routers = group
    into = np.zeros(12, dtype=np.float32)
    _push_both(g)
    peers = [_answer(routers[0], [_params([1, 2], 0, 9)]), _answer(routers[1], [_params([9, 10, 11, 12])])]
    with pytest.raises(ServerError, match="where 0 of 8 were due"):
        g.collect(5, into)
    # the next reply is read as it comes: no reply in parts was left open by the refused part
    _answer(routers[0], [_params(np.arange(8), step=6)], peers[0])
    _answer(routers[1], [_params([9, 10, 11, 12], step=6)], peers[1])
    assert g.collect(6, into).versions == [6, 6] and into.tolist() == [*range(8), 9, 10, 11, 12]


def test_the_newest_plan_of_the_replies_is_taken(group):
    """(A malformed plan never gets this far: the codec refuses the reply that carries it.)"""
    g, routers = group
    _push_both(g)
    _answer(routers[0], [_params(np.arange(8), plan=BatchPlan(7, (1, 3)))])
    _answer(routers[1], [_params(np.arange(4), plan=BatchPlan(3, (2, 2)))])
    assert g.collect(5, np.zeros(12, dtype=np.float32)).plan == BatchPlan(7, (1, 3))


def test_a_stream_of_stray_replies_does_not_keep_the_wait_from_checking_on_the_scheduler():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    checks = []
    g = ServerGroup(ctx, [f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"], [(0, 4)],
                    timeout_s=0.5, on_wait=lambda: checks.append(1), tick_s=0.05)
    g.push(0, 0, 4, Push(rank=0, step=5, version=0, batch=1, gen=0, data=np.ones(4, dtype=np.float32)))
    peer = router.recv_multipart()[0]
    stop = threading.Event()
    sent = []

    def stray():  # answers to an earlier request, read and dropped, faster than the tick
        while not stop.is_set():
            router.send_multipart([peer, *codec.encode(_params(np.arange(4), step=4))])
            sent.append(1)
            stop.wait(0.005)

    sender = threading.Thread(target=stray, daemon=True)
    sender.start()
    try:
        with pytest.raises(ServerError, match="no answer"):
            g.collect(5, np.zeros(4, dtype=np.float32))
    finally:
        stop.set()
        sender.join(10)
        ctx.destroy(linger=0)
    assert not sender.is_alive() and len(checks) >= 3  # about every 0.05 s of the 0.5 s
    assert len(sent) >= 10  # the strays did flow (a sender that failed in its thread sent none)


def _watched(g, **callbacks) -> ServerGroup:
    """A group on the same stand-in servers as `g`, with a worker's callbacks."""
    return ServerGroup(g.socks[0].context, g.endpoints, g.ranges, timeout_s=0.5, tick_s=0.01, **callbacks)


def test_an_interrupted_wait_returns_nothing_and_so_does_every_later_call_sending_nothing(group):
    """A worker's on_wait says the scheduler interrupted it (a rewind, the end of the job):
    the wait returns None, not an exception, and the group sends no more."""
    g, routers = group
    told = []
    g = _watched(g, on_wait=lambda: told.append(1) or True)
    _push_both(g)
    _answer(routers[1], [_params([9, 10, 11, 12])])  # shard 0 never answers
    into = np.zeros(12, dtype=np.float32)
    assert g.collect(5, into) is None and g.interrupted and told == [1]
    assert g.pull(into) is None and g.complete() is False and told == [1]
    routers[0].recv_multipart()  # the push sent before
    _push_both(g)
    assert not routers[0].poll(100) and not routers[1].poll(0)


@pytest.mark.parametrize("code, taken", [("bad_version", True), ("bad_rank", False)])
def test_a_refusal_interrupts_the_wait_if_on_refusal_takes_it_and_is_raised_if_not(group, code, taken):
    g, routers = group
    heard = []
    g = _watched(g, on_refusal=lambda error: heard.append((error.code, str(error))) or error.code == "bad_version")
    _push_both(g)
    _answer(routers[0], [protocol.Error(code=code, text="push computed on version 15, shard is at 10")])
    said = f"{g.name(0)} refused: {code}: push computed on version 15, shard is at 10"
    if taken:
        assert g.collect(5, np.zeros(12, dtype=np.float32)) is None and g.interrupted
    else:
        with pytest.raises(ServerError) as refusal:
            g.collect(5, np.zeros(12, dtype=np.float32))
        assert str(refusal.value) == said and refusal.value.code == code and not g.interrupted
    assert heard == [(code, said)]
