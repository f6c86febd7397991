"""Asynchronous corrections (server/asynchrony.py) on a tiny shard, against references
computed by hand in float64: each rule over a few pushes whose staleness is known."""

import numpy as np
import pytest

from omnips.batching import BatchPlan
from omnips.protocol import Params, Plan
from omnips.server.asynchrony import DC_LAMBDA, KEEP_STEP, MEAN_SPAN
from omnips.server.segments import ALIGN
from shard_helpers import PEERS, assert_same_state, make_core, push, round_trip, snapshot

X0 = np.array([1, -2, 3, 0.5, 7, 8], dtype=np.float32)  # 4 trained slots, 2 buffer slots
# (rank, step, ver): pushes in arrival order, each computed on an older version
ARRIVALS = [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 1), (2, 1, 3), (1, 1, 2), (0, 2, 4)]
STALENESS = [0, 1, 2, 2, 1, 3, 2]
LR, MU, WD, BATCH = 0.1, 0.9, 0.01, 8  # BATCH = global batch 24 / 3 workers
STEP = LR * BATCH / 24  # the remedies' rate: b_i / B of the recipe's, BSP's step per sample


def running_means(stale):
    out, mean = [], 0.0
    for k, s in enumerate(stale, 1):
        mean += (s - mean) / min(k, MEAN_SPAN)
        out.append(mean)
    return out


def grads(count, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(6).astype(np.float32) for _ in range(count)]


def drive(core, arrivals=ARRIVALS, gs=None):
    """Push `arrivals` in order; the replies' data, and each push's staleness."""
    gs = gs or grads(len(arrivals))
    replies, stale = [], []
    for (rank, step, ver), g in zip(arrivals, gs):
        before = core.version
        out = core.handle(PEERS[rank], push(rank, step, g, batch=BATCH, version=ver), 5.0)
        assert len(out) == 1 and isinstance(out[0].msg, Params) and out[0].to == PEERS[rank]
        round_trip(out)
        replies.append(np.array(out[0].msg.data, dtype=np.float64))
        stale.append(before - ver)
    return replies, stale


def recipe_run(correction, nesterov):
    """(core, replies, staleness) of ARRIVALS with grads(), SGD at LR, MU, WD under `correction`."""
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=LR, momentum=MU, weight_decay=WD,
                     init=X0, async_correction=correction, nesterov=nesterov)
    return (core, *drive(core, gs=grads(len(ARRIVALS))))


def sgd(p, buf, g, lr, mu, wd=WD, nesterov=False):
    d = g + wd * p
    buf = d.copy() if buf is None else mu * buf + d
    return p - lr * (d + mu * buf if nesterov else buf), buf


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_lowers_momentum_by_the_implicit_momentum_and_keeps_bsps_step_per_sample(nesterov):
    gs, (core, replies, stale) = grads(len(ARRIVALS)), recipe_run("momentum", nesterov)
    assert stale == STALENESS
    p, buf = X0[:4].astype(np.float64), None
    for g, mean, reply in zip(gs, running_means(stale), replies):
        mu = max(0.0, MU - mean / (1 + mean))
        lr = LR * BATCH / 24 * max(1, KEEP_STEP * (1 - mu) / (1 - MU))  # b_i / B, and most of MU's long-run step
        p, buf = sgd(p, buf, g[:4].astype(np.float64), lr, mu, nesterov=nesterov)
        np.testing.assert_allclose(reply[:4], p, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(reply[4:], g[4:])  # buffer slots: the latest values, untouched
    # staleness 0, 1, 2, 3 at momentum 0.5: the implicit momentum of their mean (1.5: 0.6) exceeds it
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=LR, momentum=0.5, weight_decay=WD,
                     init=X0, async_correction="momentum")
    drive(core, [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0)], gs[:4])
    assert core.store.correction.step(0.1, 1 / 3, core.store.opt) == (pytest.approx(0.1 / 3 * KEEP_STEP * 2), 0.0)
    # a step at momentum 0 leaves in the buffer what a plain SGD step would: g + weight decay * p
    before = core.values[:4].astype(np.float64).copy()
    drive(core, [(1, 1, 1)], [gs[4]])
    np.testing.assert_allclose(core.store.opt.buf.numpy(), gs[4][:4] + WD * before, rtol=1e-6)


def test_momentum_correction_lowers_adams_beta1_the_same_way():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=0.01, weight_decay=0.0, init=X0,
                     optimizer="adam", async_correction="momentum")
    gs = grads(len(ARRIVALS), seed=5)
    replies, stale = drive(core, gs=gs)
    p = X0[:4].astype(np.float64)
    m = v = np.zeros(4)
    for t, (g, mean, reply) in enumerate(zip(gs, running_means(stale), replies), 1):
        g = g[:4].astype(np.float64)
        b1 = max(0.0, 0.9 - mean / (1 + mean))
        m = b1 * m + (1 - b1) * g
        v = 0.999 * v + 0.001 * g * g
        lr = 0.01 * BATCH / 24  # b_i / B; Adam's step does not grow with beta1
        p = p - lr / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - 0.999 ** t) + 1e-8)
        np.testing.assert_allclose(reply[:4], p, rtol=1e-5, atol=1e-6)


def test_lookahead_replies_with_the_values_moved_along_the_momentum_and_keeps_the_shard_plain():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=LR, momentum=MU, weight_decay=WD,
                     init=X0, async_correction="lookahead")
    gs = grads(len(ARRIVALS))
    replies, stale = drive(core, gs=gs)
    p, buf = X0[:4].astype(np.float64), None
    for g, mean, reply in zip(gs, running_means(stale), replies):
        p, buf = sgd(p, buf, g[:4].astype(np.float64), STEP, MU)  # the update itself is the recipe's
        reach = MU * (1 - MU ** mean) / (1 - MU)  # MU + MU^2 + ... over `mean` further updates
        np.testing.assert_allclose(reply[:4], p - reach * STEP * buf, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(reply[4:], g[4:])
    np.testing.assert_allclose(core.values[:4], p, rtol=1e-6, atol=1e-6)


class DanaZero:
    """DANA-Zero's definitions in float64: the parameters x, a buffer v_j per worker that
    moved x by eta_j * v_j, and the look-ahead point x^ = x - MU * sum_j eta_j v_j that
    the workers compute their gradients at (and weight decay is taken at)."""

    def __init__(self, x, wd, nesterov):
        self.x, self.wd, self.nesterov, self.v = x, wd, nesterov, {}

    def ahead(self):
        return self.x - MU * sum(eta * v for v, eta in self.v.values())

    def update(self, rank, g, eta):
        d = g + self.wd * self.ahead()
        v, old = self.v.get(rank, (0.0, eta))
        v = MU * (v * old / eta) + d  # a buffer carries its momentum in parameter units when its eta changes
        self.x = self.x - eta * (d + MU * v if self.nesterov else v)
        self.v[rank] = (v, eta)

    def leave(self, rank):
        v, eta = self.v.pop(rank)
        self.x = self.x - MU * eta * v  # its pending momentum step, taken once: x^ does not move


# two workers, each push one or two versions stale, the batch plan moving in the middle
DUO = [(0, 0, 0, 12), (1, 0, 0, 12), (0, 1, 1, 12), (1, 1, 2, 12), (0, 2, 3, 16), (1, 2, 4, 8), (0, 3, 5, 16),
       (1, 3, 5, 8), (0, 4, 7, 16)]


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("wd", [0.0, WD])
def test_dana_holds_the_look_ahead_point_of_a_momentum_buffer_per_worker(nesterov, wd):
    core = make_core(mode="asp", n=6, num_trained=4, num_workers=2, global_batch=24, lr=LR, momentum=MU,
                     weight_decay=wd, init=X0, async_correction="dana", nesterov=nesterov)
    gs = grads(len(DUO) + 1)
    ref, stale = None, []
    for (rank, step, ver, batch), g in zip(DUO, gs):
        stale.append(core.version - ver)
        out = core.handle(PEERS[rank], push(rank, step, g, batch=batch, version=ver), 5.0)
        round_trip(out)
        g, eta = g[:4].astype(np.float64), LR * batch / 24
        if ref is None:  # no delay seen yet: the optimizer's own step, BSP's step per sample
            ref = DanaZero(sgd(X0[:4].astype(np.float64), None, g, eta, MU, wd=wd, nesterov=nesterov)[0], wd,
                           nesterov)
        else:
            ref.update(rank, g, eta)
        assert out[0].msg.data is core.values  # replies carry the shard: x^ itself
        np.testing.assert_allclose(core.values[:4], ref.ahead(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(core.values[4:], out[0].msg.data[4:])
    assert stale == [0, 1, 1, 1, 1, 1, 1, 2, 1]
    # a worker that leaves takes its buffer, not the values: they stay, and the other's updates go on from them
    before = core.values.copy()
    core.set_plan(Plan(plan=BatchPlan(1, (24, 0)), departed=((1, 3),)), 0.0)
    ref.leave(1)
    np.testing.assert_array_equal(core.values, before)
    assert sorted(core.store.correction.arrays()) == ["v0"]
    core.handle(PEERS[0], push(0, 5, gs[-1], batch=24, version=core.version - 1), 5.0)
    ref.update(0, gs[-1][:4].astype(np.float64), LR)
    np.testing.assert_allclose(core.values[:4], ref.ahead(), rtol=1e-5, atol=1e-6)


def test_dana_with_adam_is_the_momentum_correction():
    def run(name):
        core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=0.01, init=X0, optimizer="adam",
                         async_correction=name)
        return drive(core, gs=grads(len(ARRIVALS), seed=5))[0], core.values.copy()

    (expected, expected_values), (replies, values) = run("momentum"), run("dana")
    np.testing.assert_array_equal(values, expected_values)
    for a, b in zip(expected, replies):
        np.testing.assert_array_equal(a, b)


def test_delay_compensation_adds_lambda_g_g_times_the_drift_since_the_workers_last_reply():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=LR, momentum=MU, weight_decay=0.0,
                     init=X0, async_correction="dc")
    gs = grads(len(ARRIVALS))
    replies, _ = drive(core, gs=gs)
    p, buf, sent = X0[:4].astype(np.float64), None, {}
    for (rank, _, _), g, reply in zip(ARRIVALS, gs, replies):
        g = g[:4].astype(np.float64)
        if rank in sent:  # its first push was computed on pulled values, which the shard did not record
            g = g + DC_LAMBDA * g * g * (p - sent[rank])
        p, buf = sgd(p, buf, g, STEP, MU, wd=0.0)
        sent[rank] = p
        np.testing.assert_allclose(reply[:4], p, rtol=1e-5, atol=1e-6)


def test_gap_aware_divides_each_gradient_by_its_gap_in_mean_steps():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, lr=LR, momentum=MU, weight_decay=0.0,
                     init=X0, async_correction="gap")
    gs = grads(len(ARRIVALS))
    replies, _ = drive(core, gs=gs)
    p, buf, sent, step = X0[:4].astype(np.float64), None, {}, np.zeros(4)
    for k, ((rank, _, _), g, reply) in enumerate(zip(ARRIVALS, gs, replies), 1):
        g = g[:4].astype(np.float64)
        if rank in sent:
            gap = np.where(step > 0, np.abs(p - sent[rank]) / np.where(step > 0, step, 1), 1)
            g = g / np.maximum(gap, 1)
        new, buf = sgd(p, buf, g, STEP, MU, wd=0.0)
        weight = 1 / min(k, 16)
        step = (1 - weight) * step + weight * np.abs(new - p)
        p = sent[rank] = new
        np.testing.assert_allclose(reply[:4], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("correction", ["dana", "momentum", "lookahead", "dc", "gap"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_with_one_worker_every_correction_is_the_plain_update_bit_for_bit(correction, optimizer):
    def run(name):
        core = make_core(mode="asp", n=6, num_trained=4, num_workers=1, global_batch=8, lr=LR, momentum=MU,
                         weight_decay=WD, init=X0, async_correction=name, optimizer=optimizer)
        replies, stale = drive(core, [(0, s, s) for s in range(5)])
        assert stale == [0] * 5
        return replies, core.values.copy()

    (plain, plain_values), (corrected, values) = run("none"), run(correction)
    np.testing.assert_array_equal(values, plain_values)
    for a, b in zip(plain, corrected):
        np.testing.assert_array_equal(a, b)


def test_the_staleness_measured_survives_a_checkpoint_and_a_malformed_record_is_refused():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=X0, async_correction="momentum")
    drive(core)
    state = core.state()
    twin = make_core(mode="asp", n=6, num_trained=4, global_batch=24, async_correction="momentum")
    twin.restore(state)
    assert twin.store.correction.state() == core.store.correction.state() == {"staleness": running_means(STALENESS)[-1],
                                                          "seen": len(STALENESS)}
    bad = make_core(mode="asp", n=6, num_trained=4, global_batch=24, async_correction="momentum")
    broken = type(state)({**state.meta, "asynchrony": {"staleness": -1.0, "seen": 2}}, state.arrays)
    with pytest.raises(ValueError, match="staleness record"):
        bad.restore(broken)
    assert not bad.initialized and bad.store.correction.state() == {"staleness": 0.0, "seen": 0}


def test_danas_buffers_survive_a_checkpoint_and_a_mismatched_record_is_refused():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=X0, async_correction="dana")
    drive(core)
    state = core.state()
    assert sorted(state.arrays) == ["async.v0", "async.v1", "async.v2", "opt.momentum_buffer", "values"]
    twin = make_core(mode="asp", n=6, num_trained=4, global_batch=24, async_correction="dana")
    twin.restore(state)
    assert {k: v.tobytes() for k, v in twin.state().arrays.items()} == {k: v.tobytes() for k, v in state.arrays.items()}
    for broken, text in [({**state.arrays, "async.v1": None}, "buffers are"),
                         ({**state.arrays, "async.v1": np.zeros(3, np.float32)}, "not 4 float32"),
                         ({**state.arrays, "async.v7": np.zeros(4, np.float32)}, "buffers are")]:
        bad = make_core(mode="asp", n=6, num_trained=4, global_batch=24, async_correction="dana")
        with pytest.raises(ValueError, match=text):
            bad.restore(type(state)(state.meta, {k: v for k, v in broken.items() if v is not None}))
        assert not bad.initialized and not bad.store.correction.arrays()
    record = state.meta["asynchrony"]
    older = {**state.arrays, "async.sum": np.zeros(4, np.float32)}  # dana's older form: the values x, and their sum
    beyond = {**state.arrays, "async.v3": np.zeros(4, np.float32)}
    for meta, arrays, text in [(state.meta, older, "older form"),
                               ({**state.meta, "asynchrony": {**record, "etas": {**record["etas"], "3": 0.1}}}, beyond,
                                r"names ranks \['0', '1', '2', '3'\], the job has 3 workers")]:
        bad = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=-X0, async_correction="dana")
        drive(bad, ARRIVALS[:4])
        before = snapshot(bad), bad.store.correction.arrays()
        with pytest.raises(ValueError, match=text):
            bad.restore(type(state)(meta, arrays))
        assert_same_state(snapshot(bad), before[0])
        assert {k: v.tobytes() for k, v in bad.store.correction.arrays().items()} == \
            {k: v.tobytes() for k, v in before[1].items()}
    other = make_core(mode="asp", n=6, num_trained=4, global_batch=24, async_correction="momentum")
    with pytest.raises(ValueError):  # another correction's checkpoint: another job
        other.restore(state)


def test_dana_rescales_a_buffer_once_per_update_when_the_update_is_written_in_ranges():
    x0 = np.linspace(-1, 1, 3 * ALIGN, dtype=np.float32)
    eager, lazy = (make_core(mode="asp", n=x0.size, num_workers=2, global_batch=24, init=x0, async_correction="dana")
                   for _ in range(2))
    g = grads(1, seed=7)[0]
    for k, (rank, step, ver, batch) in enumerate(DUO):  # worker 0's eta changes at its third push
        data = np.resize(g, x0.size) * (k + 1)
        eager.handle(PEERS[rank], push(rank, step, data, batch=batch, version=ver), 0.0)
        lazy.handle(PEERS[rank], push(rank, step, data, batch=batch, version=ver), 0.0, lazy=True)
        for hi in (ALIGN, 2 * ALIGN, 3 * ALIGN):
            lazy.ready(hi)
        assert lazy.values.tobytes() == eager.values.tobytes()


def test_a_restore_refused_for_its_optimizer_state_leaves_the_staleness_record_alone():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=X0, async_correction="momentum")
    drive(core)
    state = core.state()
    other = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=X0, async_correction="momentum")
    drive(other, ARRIVALS[:2])
    before = other.store.correction.state()
    arrays = {**state.arrays, "opt.momentum_buffer": state.arrays["opt.momentum_buffer"][:2]}
    with pytest.raises(ValueError, match="momentum_buffer"):
        other.restore(type(state)(state.meta, arrays))
    assert other.store.correction.state() == before != core.store.correction.state()


@pytest.mark.parametrize("correction", ["lookahead", "dana"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_after_a_restore_look_ahead_replies_derive_from_the_restored_values_never_from_stale_ones(optimizer,
                                                                                                   correction):
    a = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=X0, async_correction=correction,
                  optimizer=optimizer)
    drive(a)
    b = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=-X0, async_correction=correction,
                  optimizer=optimizer)
    drive(b, gs=grads(len(ARRIVALS), seed=9))  # b's own look-ahead and buffers, cached for its version
    c = make_core(mode="asp", n=6, num_trained=4, global_batch=24, async_correction=correction,
                  optimizer=optimizer)  # a fresh server taking a's shard over: no step taken yet
    saved = a.state()
    dropped = a.handle(PEERS[0], push(0, 3, np.zeros(0), batch=0, version=a.version), 5.0)  # a's own reply to it
    for core in (b, c):
        core.rewind()
        core.restore(saved)
        out = core.handle(PEERS[0], push(0, 3, np.zeros(0), batch=0, version=core.version), 5.0)  # a dropped push
        # lookahead: no step since the restore, no direction to look ahead along; dana: the shard holds its
        # look-ahead point, as a's own reply carried. Either way the restored values as they are
        np.testing.assert_array_equal(out[0].msg.data, a.values)
        if correction == "dana":
            np.testing.assert_array_equal(dropped[0].msg.data, a.values)


def test_a_departed_worker_leaves_no_copy_of_the_values_sent_to_it():
    core = make_core(mode="asp", n=6, num_trained=4, global_batch=24, init=X0, async_correction="dc")
    drive(core, ARRIVALS[:3])
    assert sorted(core.store.correction._sent) == [0, 1, 2]
    core.set_plan(Plan(plan=BatchPlan(1, (12, 12, 0)), departed=((2, 0),)), 0.0)
    assert sorted(core.store.correction._sent) == [0, 1]
