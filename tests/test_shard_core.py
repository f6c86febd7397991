"""server.shard.ShardCore driven directly, no sockets: updates, barriers, refusals, pulls, plans."""

import weakref

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips import codec, protocol
from omnips.batching import BatchPlan
from omnips.protocol import Ack, Checkpoint, Heartbeat, Init, Params, Plan, Pull, Push
from omnips.server.pulls import MAX_AHEAD
from omnips.server.shard import Outgoing

from shard_helpers import PEERS, SCHED, assert_refused, assert_same_state, make_core, push, round_trip, snapshot


class SgdRef:
    """torch.optim.SGD's rule in float64 numpy (dampening 0, weight decay added to the gradient)."""

    def __init__(self, values, momentum, weight_decay, nesterov=False):
        self.p = np.asarray(values, dtype=np.float64).copy()
        self.mu, self.wd, self.nesterov = momentum, weight_decay, nesterov
        self.buf = None

    def step(self, grad, lr):
        d = np.asarray(grad, dtype=np.float64) + self.wd * self.p
        if self.mu:
            self.buf = d.copy() if self.buf is None else self.mu * self.buf + d
            d = d + self.mu * self.buf if self.nesterov else self.buf
        self.p = self.p - lr * d


# -- BSP ------------------------------------------------------------------------------


@st.composite
def bsp_case(draw):
    n = draw(st.integers(1, 24))
    lo = draw(st.integers(0, 5))
    num_trained = lo + draw(st.integers(0, n))  # slots past num_trained are model buffers
    batches = draw(st.lists(st.integers(1, 64), min_size=3, max_size=3))
    steps = draw(st.integers(1, 3))
    orders = [draw(st.permutations(range(3))) for _ in range(steps)]
    momentum = draw(st.sampled_from([0.0, 0.5, 0.9]))
    weight_decay = draw(st.sampled_from([0.0, 0.01, 0.1]))
    nesterov = momentum > 0 and draw(st.booleans())
    seed = draw(st.integers(0, 2**31))
    return n, lo, num_trained, batches, orders, momentum, weight_decay, nesterov, seed


@settings(max_examples=30, deadline=None)
@given(case=bsp_case())
def test_bsp_update_is_weighted_mean_then_torch_sgd(case):
    n, lo, num_trained, batches, orders, momentum, wd, nesterov, seed = case
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(n).astype(np.float32)
    lr = 0.1
    core = make_core(n=n, lo=lo, num_trained=num_trained, global_batch=sum(batches), lr=lr, momentum=momentum,
                     weight_decay=wd, nesterov=nesterov, init=x0)
    t = num_trained - lo
    ref = SgdRef(x0[:t], momentum, wd, nesterov)
    now = 0.0
    for step, order in enumerate(orders):
        grads = rng.standard_normal((3, n)).astype(np.float32)
        arrivals = {}
        for k, rank in enumerate(order):
            now += 0.125
            arrivals[rank] = now
            out = core.handle(PEERS[rank], push(rank, step, grads[rank], batch=batches[rank]), now)
            if k < 2:
                assert out == [] and core.version == step  # nothing before the last push
        g = (np.asarray(batches, dtype=np.float64)[:, None] * grads.astype(np.float64)).sum(0) / sum(batches)
        ref.step(g[:t], lr)
        expected = np.concatenate([ref.p, g[t:]])  # buffers: the batch-weighted mean, no optimizer
        # one reply per worker, in rank order, after the barrier
        assert [o.to for o in out] == PEERS
        assert core.version == step + 1
        for rank, o in enumerate(out):
            assert isinstance(o.msg, Params)
            assert (o.msg.step, o.msg.version, o.msg.plan) == (step, step + 1, None)
            assert o.msg.held_s == now - arrivals[rank]
            np.testing.assert_allclose(o.msg.data, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(core.values, expected, rtol=1e-6, atol=1e-6)
        round_trip(out)
    assert core.updates == len(orders)


def test_bsp_matches_torch_sgd_on_one_parameter():
    """The same numbers through torch.optim.SGD itself (not only the numpy rule)."""
    rng = np.random.default_rng(7)
    x0 = rng.standard_normal(10).astype(np.float32)
    batches = [5, 7, 20]
    core = make_core(n=10, global_batch=32, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True, init=x0)
    p = torch.nn.Parameter(torch.from_numpy(x0.astype(np.float64)))
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    for step in range(4):
        grads = rng.standard_normal((3, 10)).astype(np.float32)
        for rank in (2, 0, 1):
            out = core.handle(PEERS[rank], push(rank, step, grads[rank], batch=batches[rank]), float(step))
        p.grad = torch.from_numpy((np.array(batches, dtype=np.float64)[:, None] * grads).sum(0) / 32)
        opt.step()
        assert len(out) == 3
        np.testing.assert_allclose(core.values, p.detach().numpy(), rtol=1e-6, atol=1e-6)


def test_buffer_slots_take_the_weighted_mean_and_never_see_the_optimizer():
    # shard [4, 12) of a model with 8 trained values: local slots 0..3 trained, 4..7 buffers
    x0 = np.arange(8, dtype=np.float32)
    core = make_core(n=8, lo=4, num_trained=8, global_batch=6, lr=0.5, momentum=0.9, weight_decay=0.5, init=x0)
    batches = [1, 2, 3]
    for step in range(3):
        data = np.array([[10 * (r + 1) + step + i for i in range(8)] for r in range(3)], dtype=np.float32)
        for r in range(3):
            core.handle(PEERS[r], push(r, step, data[r], batch=batches[r]), 0.0)
        mean = (np.array(batches)[:, None] * data).sum(0) / 6
        np.testing.assert_allclose(core.values[4:], mean[4:], rtol=1e-6)
    # the optimizer holds state for the trained slots only
    assert core.store.opt.buf.numel() == 4
    assert core.store.opt.param.numel() == 4


def test_shard_of_buffers_only():
    core = make_core(n=3, lo=10, num_trained=10, global_batch=4, init=[1, 2, 3])
    for r, b in enumerate([1, 1, 2]):
        out = core.handle(PEERS[r], push(r, 0, [r, r, r], batch=b), 0.0)
    np.testing.assert_allclose(core.values, [1.25] * 3)  # (0*1 + 1*1 + 2*2) / 4
    assert len(out) == 3


def test_empty_shard_works():
    core = make_core(n=0, init=[])
    outs = []
    for r in range(3):
        outs = core.handle(PEERS[r], push(r, 0, []), 0.0)
    assert [o.msg.version for o in outs] == [1, 1, 1]


# -- refusals leave every piece of state as it was -------------------------------------


@pytest.fixture
def mid_barrier():
    """BSP after one finished step, with worker 1's push for step 1 pending."""
    core = make_core(n=4, global_batch=12, init=[1, 2, 3, 4])
    for r in range(3):
        core.handle(PEERS[r], push(r, 0, [0.5, -0.5, 1, 2]), 0.0)
    assert core.version == 1
    assert core.handle(PEERS[1], push(1, 1, [1, 1, 1, 1]), 1.0) == []
    return core


@pytest.mark.parametrize("peer, msg, code", [
    (PEERS[2], push(2, 2, [1, 1, 1, 1], version=1), "bad_step"),  # a step ahead
    (PEERS[2], push(2, 0, [1, 1, 1, 1], version=0), "bad_step"),  # a finished step
    (PEERS[2], push(2, 1, [1, 1, 1, 1], version=2), "bad_version"),  # computed on a version that does not exist
    (PEERS[1], push(1, 1, [1, 1, 1, 1]), "duplicate"),
    (b"w3", push(3, 1, [1, 1, 1, 1]), "bad_rank"),
    (PEERS[2], push(7, 1, [1, 1, 1, 1]), "bad_rank"),
    (PEERS[2], push(2, 1, [1, 1, 1]), "bad_length"),
    (PEERS[2], push(2, 1, [1, 1, 1, 1, 1]), "bad_length"),
    (PEERS[2], push(2, 1, []), "bad_length"),
    (PEERS[2], push(2, 1, [1, np.nan, 1, 1]), "non_finite"),
    (PEERS[2], push(2, 1, [1, 1, np.inf, 1]), "non_finite"),
    (PEERS[2], push(2, 1, [-np.inf, 1, 1, 1]), "non_finite"),
    (PEERS[2], push(2, 1, [3e38, 3e38, 1, 1]), "non_finite"),  # finite, but its square sum overflows
    (b"intruder", push(0, 1, [1, 1, 1, 1]), "rank_taken"),  # rank 0 was bound by its init and pushes
    (PEERS[2], push(1, 1, [1, 1, 1, 1]), "rank_taken"),  # rank 1 belongs to w1
    (PEERS[2], Init(rank=2, data=np.zeros(4, np.float32)), "bad_rank"),
    (PEERS[2], Init(rank=0, data=np.zeros(4, np.float32)), "already_initialized"),
    (PEERS[0], Init(rank=0, data=np.zeros(4, np.float32)), "already_initialized"),
    (SCHED, Pull(request=9, at=0), "version_passed"),
    (PEERS[2], Heartbeat(), "bad_op"),
    (PEERS[2], Ack(), "bad_op"),
])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_refusals_change_nothing(mid_barrier, peer, msg, code):
    core = mid_barrier
    assert_refused(core, peer, msg, code)
    # and the barrier still completes as if the refused message never came
    a = core.handle(PEERS[0], push(0, 1, [2, 2, 2, 2]), 2.0)
    b = core.handle(PEERS[2], push(2, 1, [3, 3, 3, 3]), 3.0)
    assert a == [] and [o.to for o in b] == PEERS and core.version == 2
    assert [o.msg.held_s for o in b] == [1.0, 2.0, 0.0]


def test_refused_push_does_not_bind_its_rank():
    core = make_core(n=2, init=[0, 0])
    assert_refused(core, b"evil", push(2, 0, [np.nan, 0]), "non_finite")
    assert_refused(core, b"evil", push(2, 0, [0]), "bad_length")
    assert core.handle(PEERS[2], push(2, 0, [1, 1]), 0.0) == []  # the real worker 2 is still welcome
    assert_refused(core, b"evil", push(2, 0, [1, 1]), "rank_taken")


def test_push_before_init_is_refused():
    core = make_core(n=3)
    assert_refused(core, PEERS[1], push(1, 0, [1, 2, 3]), "not_ready")
    assert not core.initialized and core.version == 0


@pytest.mark.parametrize("msg, code", [
    (Init(rank=1, data=np.zeros(3, np.float32)), "bad_rank"),
    (Init(rank=-1, data=np.zeros(3, np.float32)), "bad_rank"),
    (Init(rank=0, data=np.zeros(2, np.float32)), "bad_length"),
    (Init(rank=0, data=np.array([0, np.nan, 0], np.float32)), "non_finite"),
    (Init(rank=0, data=np.array([0, np.inf, 0], np.float32)), "non_finite"),
])
def test_bad_init_is_refused(msg, code):
    core = make_core(n=3)
    core.handle(SCHED, Pull(request=1), 0.0)  # a waiting pull must stay waiting
    assert_refused(core, PEERS[0], msg, code)
    out = core.handle(PEERS[0], Init(rank=0, data=np.ones(3, np.float32)), 1.0)
    assert [o.to for o in out] == [PEERS[0], SCHED]


# -- ASP --------------------------------------------------------------------------------


def test_asp_scales_lr_by_batch_and_records_staleness():
    x0 = np.array([1, -2, 3, 0.5, 7, 8], dtype=np.float32)  # 4 trained slots, 2 buffer slots
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=0.1, momentum=0.9, weight_decay=0.01,
                     init=x0, async_correction="none")
    ref = SgdRef(x0[:4], 0.9, 0.01)
    b_ref = 24 / 3
    rng = np.random.default_rng(3)
    # (rank, step, ver, batch): pushes that arrive in this order, computed on older versions
    plan = [(0, 0, 0, 4), (1, 0, 0, 8), (2, 0, 0, 16), (0, 1, 1, 4), (2, 1, 3, 12), (1, 1, 2, 3)]
    stale = []
    for rank, step, ver, batch in plan:
        g = rng.standard_normal(6).astype(np.float32)
        version = core.version
        out = core.handle(PEERS[rank], push(rank, step, g, batch=batch, version=ver), 5.0)
        stale.append(version - ver)
        ref.step(g[:4].astype(np.float64), 0.1 * batch / b_ref)
        assert len(out) == 1 and out[0].to == PEERS[rank]
        reply = out[0].msg
        assert isinstance(reply, Params)
        assert (reply.step, reply.version, reply.held_s, reply.plan) == (step, version + 1, 0.0, None)
        np.testing.assert_allclose(reply.data[:4], ref.p, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(reply.data[4:], g[4:])  # buffers: the latest pushed values
        round_trip(out)
    assert stale == [0, 1, 2, 2, 1, 3]
    assert core.staleness_sum == sum(stale) and core.staleness_max == 3
    assert core.updates == len(plan) and core.version == len(plan)


def test_asp_refusals():
    core = make_core(mode="asp", n=2, init=[0, 0], global_batch=6)
    core.handle(PEERS[0], push(0, 0, [1, 1]), 0.0)
    core.handle(PEERS[0], push(0, 1, [1, 1], version=1), 0.0)
    assert_refused(core, PEERS[0], push(0, 1, [1, 1], version=1), "duplicate")
    assert_refused(core, PEERS[0], push(0, 0, [1, 1], version=0), "duplicate")  # an older step
    assert_refused(core, PEERS[1], push(1, 0, [1, 1], version=3), "bad_version")
    assert_refused(core, PEERS[1], push(1, 0, [1, np.nan]), "non_finite")
    assert_refused(core, b"other", push(0, 2, [1, 1], version=2), "rank_taken")
    assert_refused(core, PEERS[1], push(3, 0, [1, 1]), "bad_rank")
    out = core.handle(PEERS[0], push(0, 5, [1, 1], version=2), 0.0)  # a later step is fine (steps may skip)
    assert out[0].msg.version == 3


# -- dropped gradients (--nan-policy skip) --------------------------------------------


def dropped(rank, step, version=None):
    return push(rank, step, [], batch=0, version=version)


def test_bsp_step_with_a_dropped_gradient_averages_the_others():
    x0 = np.array([1.0, -2.0, 3.0, 0.5], dtype=np.float32)
    core = make_core(n=4, init=x0, momentum=0.9, weight_decay=0.01)
    ref = SgdRef(x0, 0.9, 0.01)
    g0, g2 = np.array([1, 2, 3, 4], np.float32), np.array([-4, 0, 2, 8], np.float32)
    assert core.handle(PEERS[0], push(0, 0, g0, batch=4), 0.0) == []
    assert core.handle(PEERS[1], dropped(1, 0), 0.0) == []  # it still counts as arrived
    out = core.handle(PEERS[2], push(2, 0, g2, batch=12), 0.0)
    ref.step((4 * g0 + 12 * g2) / 16, 0.1)
    assert sorted(o.to for o in out) == sorted(PEERS) and core.version == 1 and core.updates == 1
    np.testing.assert_allclose(core.values, ref.p, rtol=1e-6)
    round_trip(out)


def test_bsp_step_with_every_gradient_dropped_changes_nothing_but_the_version():
    core = make_core(n=3, init=[1, 2, 3], num_workers=2)
    core.handle(PEERS[0], push(0, 0, [1, 1, 1]), 0.0)
    core.handle(PEERS[1], push(1, 0, [1, 1, 1]), 0.0)  # one real step: momentum is now non-zero
    before = snapshot(core)
    core.handle(PEERS[0], dropped(0, 1), 0.0)
    out = core.handle(PEERS[1], dropped(1, 1), 0.0)
    after = snapshot(core)
    assert len(out) == 2 and core.version == 2 and after["updates"] == before["updates"] == 1
    np.testing.assert_array_equal(after["values"], before["values"])
    np.testing.assert_array_equal(after["momentum"], before["momentum"])


def test_bsp_single_real_gradient_beside_dropped_ones_takes_the_fast_path():
    core = make_core(n=2, init=[0, 0], momentum=0.0, weight_decay=0.0, num_workers=2)
    core.handle(PEERS[0], dropped(0, 0), 0.0)
    core.handle(PEERS[1], push(1, 0, [1.0, -2.0], batch=5), 0.0)
    np.testing.assert_allclose(core.values, [-0.1, 0.2], rtol=1e-6)  # weight 1, whatever its batch


def test_asp_dropped_gradient_is_answered_without_an_update():
    core = make_core(mode="asp", n=2, init=[1, 1], global_batch=6)
    out = core.handle(PEERS[0], dropped(0, 0), 0.0)
    assert len(out) == 1 and out[0].msg.version == 0 and core.updates == 0
    np.testing.assert_array_equal(core.values, [1, 1])
    assert_refused(core, PEERS[0], dropped(0, 0), "duplicate")  # the step still counts as pushed
    assert core.handle(PEERS[0], push(0, 1, [1, 1], version=0), 0.0)[0].msg.version == 1


def test_a_dropped_gradient_carries_no_values():
    frames = [bytes(f) for f in codec.encode(push(0, 0, [1.0], batch=1))]
    header = msgpack.unpackb(frames[0])
    header["batch"] = 0
    with pytest.raises(protocol.ProtocolError, match="carries no values"):
        codec.decode([msgpack.packb(header), frames[1]])


# -- pulls ----------------------------------------------------------------------------


def test_pull_before_init_is_answered_at_init():
    core = make_core(n=3)
    assert core.handle(SCHED, Pull(request=5), 1.0) == []
    assert core.handle(b"w1", Pull(request=6, at=0), 1.5) == []
    assert core.handle(b"w2", Pull(request=7, at=1), 2.0) == []
    out = core.handle(PEERS[0], Init(rank=0, data=np.array([1, 2, 3], np.float32)), 3.5)
    assert out[0] == Outgoing(PEERS[0], Ack())
    replies = [(o.to, o.msg.request, o.msg.version, o.msg.held_s, o.msg.plan, o.msg.data.tolist()) for o in out[1:]]
    assert replies == [(SCHED, 5, 0, 2.5, None, [1, 2, 3]), (b"w1", 6, 0, 2.0, None, [1, 2, 3])]
    assert len(core._pulls.entries) == 1  # the pull at version 1 still waits


def test_pull_at_a_future_version_is_answered_exactly_then():
    core = make_core(n=2, init=[0, 0], global_batch=3, lr=1.0, momentum=0.0, weight_decay=0.0)
    assert core.handle(SCHED, Pull(request=1, at=2), 10.0) == []
    assert core.handle(SCHED, Pull(request=2, at=1), 10.5) == []
    for step in range(3):
        outs = []
        for r in range(3):
            outs += core.handle(PEERS[r], push(r, step, [1, 2], batch=1), 11.0 + step)
        pulls = [o for o in outs if o.to == SCHED]
        if step == 0:
            assert [(o.msg.request, o.msg.version, o.msg.held_s) for o in pulls] == [(2, 1, 0.5)]
            assert pulls[0].msg.data.tolist() == [-1, -2]
        elif step == 1:
            assert [(o.msg.request, o.msg.version, o.msg.held_s) for o in pulls] == [(1, 2, 2.0)]
            assert pulls[0].msg.data.tolist() == [-2, -4]
        else:
            assert pulls == []
        assert len(outs) == 3 + len(pulls)
    assert core._pulls.entries == []


def test_pull_now_and_at_the_current_version():
    core = make_core(n=2, init=[4, 5])
    for msg in (Pull(request=3), Pull(request=4, at=0)):
        out = core.handle(SCHED, msg, 1.0)
        assert len(out) == 1 and out[0].to == SCHED
        assert (out[0].msg.request, out[0].msg.version, out[0].msg.held_s, out[0].msg.plan) == (msg.request, 0, 0.0, None)
        assert out[0].msg.data.tolist() == [4, 5]


def test_pull_at_a_passed_version_is_refused():
    core = make_core(n=2, init=[0, 0])
    for r in range(3):
        core.handle(PEERS[r], push(r, 0, [1, 1]), 0.0)
    assert core.version == 1
    assert_refused(core, SCHED, Pull(request=1, at=0), "version_passed")


def test_asp_pull_at_a_future_version_is_answered():
    core = make_core(mode="asp", n=2, init=[0, 0], global_batch=6)
    assert core.handle(SCHED, Pull(request=1, at=2), 0.0) == []
    core.handle(PEERS[0], push(0, 0, [1, 1]), 1.0)
    out = core.handle(PEERS[1], push(1, 0, [1, 1]), 2.0)
    assert core.version == 2
    assert [(o.to, o.msg.request, o.msg.version) for o in out if o.to == SCHED] == [(SCHED, 1, 2)]


@pytest.mark.parametrize("mode, max_steps, last", [("bsp", 5, 5), ("asp", 5, 5 * 32), ("bsp", None, MAX_AHEAD)])
def test_a_pull_or_checkpoint_at_a_version_the_job_never_reaches_is_refused(mode, max_steps, last):
    core = make_core(mode=mode, n=2, init=[0, 0], max_steps=max_steps)
    for r in range(3):
        core.handle(PEERS[r], push(r, 0, [1, 1]), 0.0)
    last += core.version if max_steps is None else 0  # without --max-steps: MAX_AHEAD past now
    assert_refused(core, b"stranger", Pull(request=1, at=last + 1), "bad_version")
    assert_refused(core, b"stranger", Pull(request=1, at=2**62), "bad_version")
    before = snapshot(core)
    out = core.handle(b"stranger", Checkpoint(request=2, step=9, at=last + 1), 0.0)
    assert [(o.msg.request, o.msg.error.split(":")[0]) for o in out] == [(2, "bad_version")]
    assert_same_state(before, snapshot(core))
    # the scheduler's: a checkpoint before the end, the final evaluation at it
    assert core.handle(SCHED, Checkpoint(request=3, step=4, at=last - 1), 0.0) == []
    assert core.handle(SCHED, Pull(request=4, at=last), 0.0) == [] and len(core._pulls.entries) == 2


# -- batch plans ride on push replies -------------------------------------------------


def test_plan_attached_only_for_older_generations_bsp():
    core = make_core(n=2, init=[0, 0])
    core.set_plan(Plan(plan=BatchPlan(2, (10, 10, 12))), 0.0)
    core.set_plan(Plan(plan=BatchPlan(1, (1, 1, 30))), 0.0)  # older: ignored
    out = []
    for r in range(3):  # a BSP step runs one plan on every worker
        out += core.handle(PEERS[r], push(r, 0, [1, 1], gen=0), 0.0)
    assert [o.msg.plan for o in out] == [BatchPlan(2, (10, 10, 12))] * 3
    round_trip(out)
    out = []
    for r in range(3):
        out += core.handle(PEERS[r], push(r, 1, [1, 1], gen=2), 0.0)
    assert [o.msg.plan for o in out] == [None] * 3  # they have it
    core.set_plan(Plan(plan=BatchPlan(3, (8, 12, 12), stop=True)), 0.0)
    out = []
    for r in range(3):
        out += core.handle(PEERS[r], push(r, 2, [1, 1], gen=2), 0.0)
    assert [o.msg.plan for o in out] == [BatchPlan(3, (8, 12, 12), stop=True)] * 3
    # pulls never carry a plan
    assert core.handle(SCHED, Pull(request=1), 0.0)[0].msg.plan is None


def test_plan_attached_only_for_older_generations_asp():
    core = make_core(mode="asp", n=2, init=[0, 0], global_batch=6)
    assert core.handle(PEERS[0], push(0, 0, [1, 1], gen=0), 0.0)[0].msg.plan is None  # no plan yet
    core.set_plan(Plan(plan=BatchPlan(1, (1, 2, 3))), 0.0)
    assert core.handle(PEERS[0], push(0, 1, [1, 1], version=1, gen=0), 0.0)[0].msg.plan == BatchPlan(1, (1, 2, 3))
    assert core.handle(PEERS[1], push(1, 0, [1, 1], version=2, gen=1), 0.0)[0].msg.plan is None


# -- membership: workers leave and join -------------------------------------------------


def test_bsp_step_completes_without_a_departed_worker_and_drops_its_partial_push():
    core = make_core(n=2, init=[0, 0], momentum=0.0, weight_decay=0.0)
    core.handle(PEERS[0], push(0, 0, [1, 1]), 0.0)
    assert core.handle(PEERS[2], push(2, 0, [9, 9]), 0.0) == []  # reached this shard, then it died
    out = core.set_plan(Plan(plan=BatchPlan(1, (6, 6, 0)), departed=((2, -1),)), 0.0)
    assert out == [] and 2 not in core.barrier.pending  # its step-0 push reached not every shard: no shard uses it
    out = core.handle(PEERS[1], push(1, 0, [3, 3]), 0.0)
    assert sorted(o.to for o in out) == [PEERS[0], PEERS[1]] and core.version == 1
    np.testing.assert_allclose(core.values, [-0.2, -0.2], rtol=1e-6)  # mean of 1 and 3, lr 0.1
    assert out[0].msg.plan.batches == (6, 6, 0)
    assert_refused(core, PEERS[2], push(2, 1, [1, 1], gen=0), "removed")  # not dead after all: refused


def test_bsp_barrier_waiting_only_for_the_departed_completes_when_told():
    core = make_core(n=1, init=[0], num_workers=2)
    core.handle(PEERS[0], push(0, 0, [1]), 0.0)
    out = core.set_plan(Plan(plan=BatchPlan(1, (8, 0)), departed=((1, -1),)), 0.0)
    assert [o.to for o in out] == [PEERS[0]] and core.version == 1


def test_a_stop_plan_naming_a_worker_lost_mid_push_completes_the_step_it_held():
    # worker 1 froze during a stop after pushing step 0 to another shard, not to this one: the
    # stop's plan names it lost, and this shard ends step 0 with what it holds, as the other did
    core = make_core(n=1, init=[0], num_workers=2)
    assert core.handle(PEERS[0], push(0, 0, [1]), 0.0) == []
    core.set_plan(Plan(plan=BatchPlan(1, (4, 4), stop=True)), 0.0)
    assert core.version == 0  # the stop: each worker stops after its step, which waits for both
    out = core.set_plan(Plan(plan=BatchPlan(1, (4, 4), stop=True), departed=((1, -1),)), 0.0)
    assert [o.to for o in out] == [PEERS[0]] and core.version == 1


def test_a_plan_for_another_number_of_workers_is_refused_and_changes_nothing():
    core = make_core(n=2, init=[0, 0], num_workers=2)
    before = snapshot(core)
    for batches in ([8], [4, 4, 4]):
        with pytest.raises(ValueError, match=f"the scheduler sent a plan's batches for {len(batches)} workers, the job has 2"):
            core.set_plan(Plan(plan=BatchPlan(1, tuple(batches))), 0.0)
    assert_same_state(before, snapshot(core))
    assert core.plan is None


def test_a_joiner_pulls_at_the_first_step_of_its_plan_and_the_step_waits_for_it():
    core = make_core(n=2, init=[0, 0], num_workers=3)
    core.set_plan(Plan(plan=BatchPlan(0, (8, 8, 0))), 0.0)
    for r in (0, 1):
        core.handle(PEERS[r], push(r, 0, [1, 1]), 0.0)
    assert core.version == 1  # the vacant rank is not waited for
    core.set_plan(Plan(plan=BatchPlan(1, (6, 5, 5))), 0.0)
    assert core.handle(PEERS[2], Pull(request=7, gen=1), 0.0) == []  # step 1 still runs plan 0
    for r in (0, 1):
        out = core.handle(PEERS[r], push(r, 1, [1, 1]), 0.0)
    assert core.version == 2 and out[0].msg.plan.gen == 1  # the others learn the plan with this reply
    out = core.handle(PEERS[0], push(0, 2, [1, 1], gen=1), 0.0)
    assert [o.to for o in out] == [PEERS[2]]  # the first push under plan 1 releases the joiner's pull
    reply = out[0].msg
    assert reply.version == 2 and reply.plan == BatchPlan(1, (6, 5, 5))
    assert core.handle(PEERS[1], push(1, 2, [1, 1], gen=1), 0.0) == []  # and step 2 waits for it
    out = core.handle(PEERS[2], push(2, 2, [1, 1], gen=1), 0.0)
    assert len(out) == 3 and core.version == 3
    core.handle(PEERS[0], push(0, 3, [1, 1], gen=1), 0.0)
    assert_refused(core, PEERS[1], push(1, 3, [1, 1], gen=0), "bad_gen")  # a step runs one plan


def test_bsp_refuses_a_push_under_a_plan_no_step_runs_any_more():
    core = make_core(n=2, init=[0, 0], num_workers=2)
    core.set_plan(Plan(plan=BatchPlan(1, (16, 16))), 0.0)
    for r in (0, 1):
        core.handle(PEERS[r], push(r, 0, [1, 1], gen=1), 0.0)
    assert core.version == 1  # step 0 ran plan 1: plan 0 is done
    assert_refused(core, PEERS[0], push(0, 1, [1, 1], gen=0), "bad_gen")
    assert core.barrier.gen is None
    # a newer plan may reach a worker (in another shard's reply) first: its step waits for it
    assert core.handle(PEERS[0], push(0, 1, [1, 1], gen=2), 0.0) == []
    assert core.handle(PEERS[1], push(1, 1, [1, 1], gen=2), 0.0) == []
    out = core.set_plan(Plan(plan=BatchPlan(2, (8, 24))), 0.0)
    assert core.version == 2 and sorted(o.to for o in out) == PEERS[:2]


def test_a_refilled_rank_binds_to_the_new_connection_and_refuses_the_old():
    core = make_core(mode="asp", n=2, init=[0, 0], global_batch=6, num_workers=2)
    core.handle(PEERS[1], push(1, 0, [1, 1]), 0.0)
    core.set_plan(Plan(plan=BatchPlan(1, (6, 0)), departed=((1, 0),)), 0.0)
    assert_refused(core, PEERS[1], push(1, 1, [1, 1], version=1), "removed")
    core.set_plan(Plan(plan=BatchPlan(2, (3, 3))), 0.0)
    assert_refused(core, PEERS[1], push(1, 1, [1, 1], version=1, gen=1), "removed")  # the old one, on an old plan
    out = core.handle(b"new", push(1, 5, [1, 1], version=1, gen=2), 0.0)  # the new one: its own step count
    assert isinstance(out[0].msg, Params)


def test_ssp_does_not_wait_for_a_departed_worker():
    core = make_core(mode="ssp", n=1, init=[0], global_batch=6, staleness=1)
    for step in range(2):
        for r in (0, 1, 2):
            core.handle(PEERS[r], push(r, step, [1], version=core.version), 0.0)
    assert core.handle(PEERS[0], push(0, 2, [1], version=core.version), 0.0) != []  # 2 - 1 <= 1
    assert core.handle(PEERS[0], push(0, 3, [1], version=core.version), 0.0) == []  # held: worker 2 is at 1
    core.handle(PEERS[1], push(1, 2, [1], version=core.version), 0.0)
    out = core.set_plan(Plan(plan=BatchPlan(1, (3, 3, 0)), departed=((2, 1),)), 0.0)
    assert [o.to for o in out] == [PEERS[0]]  # the slowest present worker is at 2 now


def test_ssp_refuses_a_push_while_its_last_reply_is_held_and_keeps_no_gradient():
    core = make_core(mode="ssp", n=4, init=np.zeros(4), global_batch=4, num_workers=2, staleness=0)
    g = np.ones(4, np.float32)
    gone = weakref.ref(g)
    assert core.handle(PEERS[0], push(0, 0, g), 0.0) == []  # held: worker 1 has not pushed yet
    del g
    assert gone() is None  # the held reply does not keep the gradient
    for step in (1, 2, 10**15):
        assert_refused(core, PEERS[0], push(0, step, [1, 1, 1, 1], version=1), "reply_held")
    assert len(core.holds.held) == 1 and core.updates == 1
    out = core.handle(PEERS[1], push(1, 0, [1, 1, 1, 1]), 1.0)
    assert [(o.to, o.msg.step) for o in out] == [(PEERS[0], 0), (PEERS[1], 0)]
    assert core.handle(PEERS[0], push(0, 1, [1, 1, 1, 1], version=2), 2.0) == []  # answered: it may push again


# -- replies still queued ------------------------------------------------------------------


@pytest.mark.parametrize("optimizer, wire", [("sgd", "float32"), ("adam", "float16")])
def test_detach_leaves_queued_replies_as_sent_and_the_updates_as_they_would_be(optimizer, wire):
    """A push's reply aliases the shard (zero-copy) until it has left; a server whose receiver
    does not read detaches the shard rather than wait: what was queued stays as it was sent,
    and every later step, reply and optimizer state is bit for bit that of a shard never detached."""
    dtype = np.float32 if wire == "float32" else np.float16
    kept, detached = (make_core(n=6, num_trained=4, optimizer=optimizer, wire_dtype=wire, init=np.arange(6) / 6)
                      for _ in range(2))
    queued = []  # (a reply's values as queued, their bytes when it was made): the old buffers live on in them
    first_kept = None  # the first reply of the shard never detached
    for step in range(3):
        grads = [np.linspace(-1, 1, 6).astype(dtype) * (r + 1) * (step + 1) for r in range(3)]
        outs = []
        for core in (kept, detached):
            out = []
            for r in range(3):
                out += core.handle(PEERS[r], Push(rank=r, step=step, version=step, batch=4 + r, gen=0, data=grads[r]), 0.0)
            assert len(out) == 3 and not any(o.snapshot for o in out)
            outs.append(out)
        for a, b in zip(*outs):
            assert a.msg.data.dtype == dtype and a.msg.data.tobytes() == b.msg.data.tobytes()
        queued += [(o.msg.data, o.msg.data.tobytes()) for o in outs[1]]
        if step == 0:
            first_kept = outs[0][0].msg.data
        detached.detach()
    assert all(data.tobytes() == sent for data, sent in queued)
    assert first_kept.tobytes() != queued[0][1]  # undetached, the first reply's buffer moved on with the shard
    assert detached.values.tobytes() == kept.values.tobytes() and detached.detached == 3
    for a, b in zip(kept.state().arrays.values(), detached.state().arrays.values()):
        assert a.tobytes() == b.tobytes()


def test_a_log_line_names_a_connection_by_the_worker_that_pushes_from_it():
    core = make_core(mode="asp", init=[0.0] * 6)
    core.handle(PEERS[2], push(2, 0, [0.1] * 6), 0.0)
    assert core.describe(PEERS[2]) == "worker 2"
    assert core.describe(PEERS[1]) == "a connection that has not pushed (b'w1')"
