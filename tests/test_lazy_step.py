"""A step written range by range (ShardCore.handle(..., lazy=True) and ready(hi), as the
server sends each reply part) is bit-for-bit the step written whole, in values, replies
and optimizer state; ranges not yet asked for keep the values from before the step."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.protocol import Params, Pull, Push
from server.segments import ALIGN
from server.shard import ShardCore

from shard_helpers import PEERS, make_core, parts_of, push



def _pushed(core: ShardCore, values: np.ndarray, cuts: list[int], **fields):
    """The push of `values` as the job's wire dtype carries it, whole or in parts at `cuts`."""
    data = core.wire.buffer(values.size)
    if data is None:
        data = values
    else:
        core.wire.narrow(values, data)
    if cuts:
        return parts_of(data, cuts, **fields)
    return [Push(rank=fields["rank"], step=fields["step"], ver=fields["ver"], batch=fields["batch"], gen=0, data=data)]


def _state(core: ShardCore) -> tuple:
    scalars, buffers = core._opt.state()
    return core.values.copy(), scalars, buffers, core.version, core.updates


@st.composite
def cases(draw):
    n = draw(st.integers(1, 5 * ALIGN + 7))
    return dict(
        mode=draw(st.sampled_from(["bsp", "asp"])),
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
              global_batch=12, init=x0)
    eager, lazy = make_core(**kw), make_core(**kw)
    for step, cuts_of_ready in enumerate(case["ready"]):
        before = lazy.values.copy()
        grads = rng.standard_normal((3, n)).astype(np.float32)
        ranks = range(3) if mode == "bsp" else [step % 3]
        for rank in ranks:
            batch = case["batches"][rank] if mode == "bsp" else max(1, case["batches"][rank])
            fields = dict(rank=rank, step=step if mode == "bsp" else step // 3, batch=batch, ver=eager.version)
            if not batch:
                msgs = [push(rank, fields["step"], grads[rank][:0], batch=0, ver=eager.version)]
            else:
                msgs = _pushed(eager, grads[rank], case["cuts"], **fields)
            for msg in msgs:
                want = eager.handle(PEERS[rank], msg, 0.0)
                got = lazy.handle(PEERS[rank], msg, 0.0, lazy=True)
        assert [(o.to, type(o.msg)) for o in got] == [(o.to, type(o.msg)) for o in want]
        assert all(isinstance(o.msg, Params) for o in got) and got
        stepped = any(case["batches"]) or mode == "asp"
        for hi in cuts_of_ready:
            lazy.ready(hi)
            upto = min(n, -(-hi // ALIGN) * ALIGN)  # ranges end at multiples of ALIGN
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g.msg.data[:hi], w.msg.data[:hi])
            np.testing.assert_array_equal(lazy.values[:upto], eager.values[:upto])
            if stepped:  # the rest is written only when asked for
                np.testing.assert_array_equal(lazy.values[upto:], before[upto:])
        if step == 1:  # the next message finds the step still partly unwritten: it is written first
            lazy.handle(PEERS[0], Pull(req=9), 0.0, lazy=True)
            eager.handle(PEERS[0], Pull(req=9), 0.0)
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
    eager, lazy = make_core(mode="asp", n=x0.size, init=x0), make_core(mode="asp", n=x0.size, init=x0)
    g = np.full(x0.size, 0.5, dtype=np.float32)
    eager.handle(PEERS[0], push(0, 0, g), 0.0)
    lazy.handle(PEERS[0], push(0, 0, g), 0.0, lazy=True)
    assert not np.array_equal(lazy.values, eager.values)  # nothing written yet
    np.testing.assert_array_equal(lazy.state().arrays["values"], eager.values)
    eager.handle(PEERS[0], push(0, 1, g, ver=1), 0.0)
    lazy.handle(PEERS[0], push(0, 1, g, ver=1), 0.0, lazy=True)
    lazy.detach()
    np.testing.assert_array_equal(lazy.values, eager.values)
    assert torch.equal(lazy._opt.buf, eager._opt.buf)
