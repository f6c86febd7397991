"""A step written range by range (ShardCore.handle(..., lazy=True) and ready(hi), as the
server sends each reply part) is bit-for-bit the step written whole, in values, replies
and optimizer state; ranges not yet asked for keep the values from before the step."""

from dataclasses import replace

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from shard_helpers import PEERS, SCHED, make_core, parts_of, push

from omnips import codec
from omnips.batching import BatchPlan
from omnips.job import ASYNC_CORRECTIONS
from omnips.protocol import MAX_PARTS, Checkpoint, Params, Plan, Pull, Push
from omnips.server import service
from omnips.server.outbox import Outbox
from omnips.server.segments import ALIGN
from omnips.server.shard import Outgoing, ShardCore



def _pushed(core: ShardCore, values: np.ndarray, cuts: list[int], **fields):
    """The push of `values` as the job's wire dtype carries it, whole or in parts at `cuts`."""
    data = core.wire.buffer(values.size)
    if data is None:
        data = values
    else:
        core.wire.narrow(values, data)
    if cuts:
        return parts_of(data, cuts, **fields)
    return [Push(rank=fields["rank"], step=fields["step"], version=fields["version"], batch=fields["batch"], gen=0, data=data)]


def _state(core: ShardCore) -> tuple:
    scalars, buffers = core.store.opt.state()
    return core.values.copy(), scalars, buffers, core.version, core.updates


@st.composite
def cases(draw):
    n = draw(st.integers(1, 5 * ALIGN + 7))
    return dict(
        mode=draw(st.sampled_from(["bsp", "asp"])),
        correction=draw(st.sampled_from(ASYNC_CORRECTIONS)),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        wire=draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        n=n,
        trained=draw(st.integers(0, n)),
        batches=draw(st.lists(st.integers(0, 9), min_size=3, max_size=3)),
        cuts=draw(st.lists(st.integers(1, n), max_size=2, unique=True).map(sorted)) if n > 1 else [],
        ready=[draw(st.lists(st.integers(0, n + ALIGN), max_size=4).map(sorted)) for _ in range(3)],
    )


@settings(max_examples=60, deadline=None)
@given(cases())
def test_a_step_written_in_ranges_is_the_step_written_whole(case):
    n, mode = case["n"], case["mode"]
    rng = np.random.default_rng(n)
    x0 = rng.standard_normal(n).astype(np.float32)
    kw = dict(mode=mode, n=n, num_trained=case["trained"], wire_dtype=case["wire"], optimizer=case["optimizer"],
              global_batch=12, init=x0, async_correction=case["correction"])
    eager, lazy = make_core(**kw), make_core(**kw)
    for step, cuts_of_ready in enumerate(case["ready"]):
        before = lazy.values.copy()
        grads = rng.standard_normal((3, n)).astype(np.float32)
        ranks = range(3) if mode == "bsp" else [step % 3]
        for rank in ranks:
            batch = case["batches"][rank] if mode == "bsp" else max(1, case["batches"][rank])
            # ASP: computed two versions back, so that every correction has a staleness to act on
            ver = eager.version if mode == "bsp" else max(0, eager.version - 2)
            fields = dict(rank=rank, step=step if mode == "bsp" else step // 3, batch=batch, version=ver)
            if not batch:
                msgs = [push(rank, fields["step"], grads[rank][:0], batch=0, version=ver)]
            else:
                msgs = _pushed(eager, grads[rank], case["cuts"], **fields)
            for msg in msgs:
                want = eager.handle(PEERS[rank], msg, 0.0)
                got = lazy.handle(PEERS[rank], msg, 0.0, lazy=True)
        assert [(o.to, type(o.msg)) for o in got] == [(o.to, type(o.msg)) for o in want]
        assert all(isinstance(o.msg, Params) for o in got) and got
        stepped = any(case["batches"]) or mode == "asp"
        # corrections that read the whole step to answer (look-ahead replies, values sent kept) write it whole
        whole = mode == "asp" and (lazy.store.correction.tracks_sent or lazy.store.correction.moves_replies)
        for hi in cuts_of_ready:
            lazy.ready(hi)
            upto = min(n, -(-hi // ALIGN) * ALIGN)  # ranges end at multiples of ALIGN
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.msg.data[:hi], w.msg.data[:hi])
            np.testing.assert_array_equal(lazy.values[:upto], eager.values[:upto])
            if stepped and not whole:  # the rest is written only when asked for
                np.testing.assert_array_equal(lazy.values[upto:], before[upto:])
        if step == 1:  # the next message finds the step still partly unwritten: it is written first
            lazy.handle(PEERS[0], Pull(request=9), 0.0, lazy=True)
            eager.handle(PEERS[0], Pull(request=9), 0.0)
        lazy.ready(n)
        for g, w in zip(got, want):
            assert g.msg.data.dtype == w.msg.data.dtype
            np.testing.assert_array_equal(g.msg.data, w.msg.data)
        a, b = _state(lazy), _state(eager)
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1] == b[1] and a[3:] == b[3:]
        for name in a[2]:
            np.testing.assert_array_equal(a[2][name], b[2][name])
    assert lazy.updates == eager.updates > 0 or not any(case["batches"])


def test_state_and_detach_write_the_step_first():
    """What reads the whole shard (a checkpoint's state, the move to fresh buffers) sees the
    step a lazy handle took, though no reply part asked for it."""
    x0 = np.linspace(-1, 1, 4 * ALIGN, dtype=np.float32)
    # (a correction whose replies are the shard's own values: one that moves them writes the step whole at once)
    eager, lazy = (make_core(mode="asp", n=x0.size, init=x0, async_correction="momentum") for _ in range(2))
    g = np.full(x0.size, 0.5, dtype=np.float32)
    eager.handle(PEERS[0], push(0, 0, g), 0.0)
    lazy.handle(PEERS[0], push(0, 0, g), 0.0, lazy=True)
    assert not np.array_equal(lazy.values, eager.values)  # nothing written yet
    np.testing.assert_array_equal(lazy.state().arrays["values"], eager.values)
    eager.handle(PEERS[0], push(0, 1, g, version=1), 0.0)
    lazy.handle(PEERS[0], push(0, 1, g, version=1), 0.0, lazy=True)
    lazy.detach()
    np.testing.assert_array_equal(lazy.values, eager.values)
    assert torch.equal(lazy.store.opt.buf, eager.store.opt.buf)


def test_a_held_ssp_reply_carries_the_narrowed_shard_of_the_step_that_releases_it():
    """SSP, bfloat16 wire: a reply held for the slowest worker is released by a later message
    whose own step narrows nothing; it must still carry the shard as it is, narrowed."""
    n = 3 * ALIGN + 5
    x0 = np.linspace(-1, 1, n, dtype=np.float32)
    core = make_core(mode="ssp", n=n, num_workers=2, staleness=0, wire_dtype="bfloat16", init=x0)

    def step(rank, s, batch):
        data = core.wire.buffer(n)
        core.wire.narrow(np.full(n, 0.5 + rank, dtype=np.float32), data)
        msg = Push(rank=rank, step=s, version=core.version, batch=batch, gen=0,
                   data=data if batch else np.zeros(0, dtype=np.float32))
        out = core.handle(PEERS[rank], msg, 0.0, lazy=True)
        core.ready(n)
        return out

    step(0, 0, 4)
    step(1, 0, 4)
    assert step(0, 1, 4) == []  # worker 0 is a step ahead: held
    (released,) = step(1, 1, 0)[:1]  # worker 1 drops its gradient: worker 0's reply goes
    assert released.to == PEERS[0] and released.msg.version == core.version == 3
    want = core.wire.buffer(n)
    core.wire.narrow(core.values, want)
    assert released.msg.data.tobytes() == want.tobytes()


def test_a_plan_that_completes_a_bsp_step_writes_it_lazily_too():
    """A worker leaves: the plan completes the step the others pushed, range by range."""
    x0 = np.linspace(-1, 1, 2 * ALIGN, dtype=np.float32)
    eager, lazy = (make_core(n=x0.size, init=x0) for _ in range(2))
    g = [np.full(x0.size, r + 1.0, dtype=np.float32) for r in range(3)]
    plan = Plan(plan=BatchPlan(1, (4, 4, 0)), departed=((2, -1),))
    for core in (eager, lazy):
        for r in (0, 1):
            assert core.handle(PEERS[r], push(r, 0, g[r]), 0.0, lazy=core is lazy) == []
    want = eager.set_plan(plan, 0.0)
    got = lazy.set_plan(plan, 0.0, lazy=True)
    assert len(got) == len(want) == 2 and lazy.version == eager.version == 1
    before = lazy.values.copy()
    lazy.ready(1)
    np.testing.assert_array_equal(lazy.values[:ALIGN], eager.values[:ALIGN])
    np.testing.assert_array_equal(lazy.values[ALIGN:], before[ALIGN:])
    lazy.ready(x0.size)
    np.testing.assert_array_equal(lazy.values, eager.values)


class _Writer:
    """A checkpoint writer that notes how many reply parts had been sent when it was handed a snapshot."""

    def __init__(self, peer):
        self.peer, self.seen = peer, []

    def submit(self, snap):
        sent = 0
        while self.peer.poll(0):
            self.peer.recv_multipart()
            sent += 1
        self.seen.append(sent)
        return []


def test_the_server_sends_each_part_once_written_part_by_part_across_replies_and_checkpoints_after():
    """server.service._send over real sockets: every reply part a worker receives is the
    eager core's, in order; BSP replies go part k of each, then part k + 1; the checkpoint
    due at the same version goes to the writer after the replies left."""
    n, part = 5 * ALIGN + 3, 2 * ALIGN
    x0 = np.linspace(-1, 1, n, dtype=np.float32)
    eager, lazy = (make_core(n=n, num_workers=2, init=x0) for _ in range(2))
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.bind("inproc://shard")
        dealers = []
        for peer in PEERS[:2]:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.IDENTITY, peer)
            d.connect("inproc://shard")
            dealers.append(d)
        ckpt = Checkpoint(request=7, step=1, at=1)
        for core in (eager, lazy):
            assert core.handle(SCHED, ckpt, 0.0) == []
        grads = [np.full(n, r + 0.25, dtype=np.float32) for r in range(2)]
        want = []
        for r in range(2):
            msg = replace(push(r, 0, grads[r]), reply_part=part)
            want += eager.handle(PEERS[r], msg, 0.0)
            got = lazy.handle(PEERS[r], msg, 0.0, lazy=True)
        order = []
        real_ready = lazy.ready
        lazy.ready = lambda hi: order.append(hi) or real_ready(hi)
        writer = _Writer(dealers[1])
        service._send(router, lazy, got, Outbox(grace_s=1.0), writer)
        assert writer.seen == [3]  # worker 1's three parts were out before the checkpoint was handed on
        replies = [o for o in want if isinstance(o, Outgoing)]
        for d, reply in zip(dealers[:1], replies):
            frames = [d.recv_multipart() for _ in range(3)]
            parts = [codec.decode(f) for f in frames]
            assert [p.offset for p in parts] == [0, part, 2 * part]
            data = np.concatenate([p.data for p in parts])
            assert data.tobytes() == reply.msg.data.tobytes()
        assert order[:6] == [part, part, 2 * part, 2 * part, n, n]  # part k of each reply, then k + 1
        assert set(order[6:]) == {n}  # then whatever no part asked for
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("asked, part", [(1, 4), (7, 7), (2 * ALIGN, 2 * ALIGN)])  # 773 values: 4 at least
def test_a_reply_is_never_cut_into_more_than_max_parts(asked, part):
    # a push asking for parts of a few values (a worker's --bucket-size of a few bytes, or a
    # hostile peer) would otherwise make one message into one per value
    n = 3 * MAX_PARTS + 5
    core = make_core(mode="asp", n=n, num_workers=1, init=np.zeros(n, dtype=np.float32))
    out = core.handle(PEERS[0], replace(push(0, 0, np.full(n, 0.5, dtype=np.float32)), reply_part=asked), 0.0)
    messages = service._parts(out[0])
    assert len(messages) == -(-n // part) <= MAX_PARTS and messages[0].data.size == part
    assert [m.offset for m in messages] == list(range(0, n, part))
    assert np.concatenate([m.data for m in messages]).tobytes() == core.values.tobytes()
