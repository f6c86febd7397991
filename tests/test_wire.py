"""--wire-dtype: float32 <-> bfloat16 / float16 conversions checked against references
built another way, a shard server's use of them, and digits trained end to end."""

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from omnips import protocol
from omnips.flat import all_finite
from omnips.job import WIRE_DTYPES, JobSpec
from omnips.launch import WorkerSpec
from omnips.protocol import Init, Pull, Push
from omnips.wire import TAGS, WireDtype

from shard_helpers import PEERS, SCHED, assert_refused, make_core, round_trip

F32, BF16, F16 = (WireDtype(name) for name in WIRE_DTYPES)
NARROW = [BF16, F16]
PROPS = settings(max_examples=150, deadline=None)


def from_bits(bits, dtype="<u4", as_=np.float32) -> np.ndarray:
    return np.array(bits, dtype=dtype).view(as_)


def _bits_of(x: float) -> int:
    return int(np.array([x], np.float32).view("<u4")[0])


# float32 values: any bit pattern; ordinary floats; ties and near-ties for bfloat16
# (low 16 bits around 0x8000) and float16 (low 13 bits around 0x1000); the float16 overflow edge
ELEMENT = st.one_of(
    st.integers(0, 2**32 - 1),
    st.floats(width=32).map(_bits_of),
    st.tuples(st.integers(0, 2**16 - 1), st.sampled_from([0x7FFF, 0x8000, 0x8001, 0])).map(
        lambda t: (t[0] << 16) | t[1]),
    st.tuples(st.integers(0, 2**19 - 1), st.sampled_from([0x0FFF, 0x1000, 0x1001])).map(
        lambda t: (t[0] << 13) | t[1]),
    st.sampled_from([65504.0, 65519.996, 65520.0, -65520.0, 65536.0]).map(_bits_of),
)
F32_ARRAYS = st.lists(ELEMENT, max_size=40).map(lambda bits: from_bits(bits))


def narrowed(w: WireDtype, x: np.ndarray) -> np.ndarray:
    return w.narrow(x, w.buffer(x.size))


def widened(w: WireDtype, data: np.ndarray) -> np.ndarray:
    return w.widen(data, np.empty(data.size, np.float32))


# -- references ---------------------------------------------------------------------


def _bf16_value(b: int) -> Fraction:
    """Exact value of bfloat16 bits (inf counts as 2**128: IEEE rounds to it as to the next
    binade's first value)."""
    if b & 0x7FFF == 0x7F80:
        return Fraction(-(2**128) if b & 0x8000 else 2**128)
    return Fraction(float(from_bits([b << 16])[0]))


def bf16_reference(x: np.float32) -> int:
    """Nearest bfloat16 to x, ties to even, by exact arithmetic on the two candidates."""
    down = _bits_of(x) >> 16  # truncated: toward zero
    if down & 0x7F80 == 0x7F80:  # inf stays inf (NaN is checked apart)
        return down
    up = down + 1  # the next value away from zero (0x7F80: inf)
    v = Fraction(float(x))
    d_down, d_up = abs(v - _bf16_value(down)), abs(v - _bf16_value(up))
    if d_down != d_up:
        return down if d_down < d_up else up
    return down if down % 2 == 0 else up


# -- conversions --------------------------------------------------------------------


def test_names_tags_and_storage():
    assert tuple(TAGS) == WIRE_DTYPES and all(tag in protocol.DTYPES for tag in TAGS.values())
    assert [w.dtype.itemsize for w in (F32, BF16, F16)] == [4, 2, 2]
    with pytest.raises(ValueError, match="wire dtype must be one of"):
        WireDtype("float8")


@PROPS
@given(x=F32_ARRAYS)
@example(x=from_bits([0x3F808000, 0x3F818000, 0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x7F800001, 0x00008000,
                      0x80000000]))
def test_bfloat16_rounds_to_nearest_even(x):
    got = narrowed(BF16, x)
    assert got.dtype == np.uint16 and got.size == x.size
    for xi, g in zip(x, got.tolist()):
        if np.isnan(xi):
            assert g & 0x7F80 == 0x7F80 and g & 0x7F, hex(g)  # NaN stays NaN (0x7F800001 must not become inf)
        else:
            assert g == bf16_reference(xi), (float(xi), hex(g))


@PROPS
@given(x=F32_ARRAYS)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float16_rounds_as_numpy_does(x):
    got = narrowed(F16, x)
    want = x.astype(np.float16)  # numpy's own conversion: round to nearest even, overflow to inf
    assert got.dtype == np.float16
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert got[~nan].view("<u2").tolist() == want[~nan].view("<u2").tolist()


@pytest.mark.parametrize("w", NARROW, ids=lambda w: w.name)
def test_widening_is_exact_and_narrowing_it_again_gives_it_back(w):
    every = np.arange(2**16, dtype=np.uint32).astype("<u2").view(w.dtype)  # all 65536 bit patterns
    got = widened(w, every)
    want = (every.view("<u2").astype("<u4") << 16).view("<f4") if w is BF16 else every.astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == (254 if w is BF16 else 2046)
    assert got[~nan].view("<u4").tolist() == want[~nan].view("<u4").tolist()
    assert narrowed(w, got)[~nan].view("<u2").tolist() == every[~nan].view("<u2").tolist()


@PROPS
@given(x=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=40).map(
    lambda v: np.array(v, np.float32)))
def test_round_trip_error_is_at_most_half_a_unit_in_the_last_place(x):
    for w, u, tiny, limit in ((BF16, 2.0**-8, 2.0**-134, 3.3961e38), (F16, 2.0**-11, 2.0**-25, 65520.0)):
        inside = np.abs(x) < limit
        back = widened(w, narrowed(w, x)).astype(np.float64)
        err = np.abs(back - x.astype(np.float64))
        assert (err[inside] <= np.maximum(u * np.abs(x[inside].astype(np.float64)), tiny)).all(), w
        assert np.isinf(back[~inside]).all() and (np.sign(back[~inside]) == np.sign(x[~inside])).all()


@PROPS
@given(x=F32_ARRAYS)
@example(x=np.array([65519.996, -65504.0], np.float32))
@example(x=np.array([1.0, 65520.0], np.float32))
@example(x=np.array([-65520.0], np.float32))
@pytest.mark.filterwarnings("ignore:overflow encountered in dot:RuntimeWarning")
def test_finite_means_every_value_arrives_finite(x):
    for w in (F32, BF16, F16):
        arrives = all_finite(x) and bool(np.isfinite(widened(w, narrowed(w, x))).all())
        assert w.finite(x) == arrives, (w, x)


def test_conversions_write_into_the_buffers_given():
    x = np.linspace(-3, 3, 10, dtype=np.float32)
    assert F32.buffer(10) is None and F32.narrow(x, None) is x  # float32 travels as it is
    for w in NARROW:
        buf = w.buffer(10)
        assert buf.ctypes.data % 4096 == 0 and w.narrow(x, buf) is buf
        out = np.empty(10, np.float32)
        assert w.widen(buf, out) is out
        for bad in (None, np.empty(10, np.float32), w.buffer(9), np.empty(20, w.dtype)[::2]):
            with pytest.raises(ValueError):
                w.narrow(x, bad)
        with pytest.raises(ValueError):
            w.widen(x, out)  # float32 is not this wire dtype
        with pytest.raises(ValueError):
            w.widen(buf, np.empty(9, np.float32))


def test_job_refuses_an_unknown_wire_dtype():
    with pytest.raises(ValueError, match="--wire-dtype must be one of float32, bfloat16, float16"):
        JobSpec(wire_dtype="int8").check()


# -- a shard server with a narrow wire ------------------------------------------------


def narrow_push(w, rank, step, values, batch=4):
    data = np.asarray(values, np.float32)
    return Push(rank=rank, step=step, version=step, batch=batch, gen=0, data=narrowed(w, data))


@pytest.mark.parametrize("w", NARROW, ids=lambda w: w.name)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), orders=st.lists(st.permutations(range(3)), min_size=2, max_size=3),
       batches=st.lists(st.integers(1, 40), min_size=3, max_size=3))
def test_bsp_narrow_pushes_update_as_their_float32_values_would(w, seed, orders, batches):
    """Each push widened into its rank's buffer and summed in rank order: the same bits as a
    float32 job given the widened gradients, whatever order they arrive in."""
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(7).astype(np.float32)
    narrow, exact = make_core(n=7, init=x0, wire_dtype=w.name), make_core(n=7, init=x0)
    for step, order in enumerate(orders):
        grads = [narrowed(w, rng.standard_normal(7).astype(np.float32)) for _ in range(3)]
        for r in order:
            out = narrow.handle(PEERS[r], Push(rank=r, step=step, version=step, batch=batches[r], gen=0,
                                               data=grads[r]), 1.0)
        for r in reversed(order):
            exact.handle(PEERS[r], Push(rank=r, step=step, version=step, batch=batches[r], gen=0,
                                        data=widened(w, grads[r])), 1.0)
        assert narrow.values.tobytes() == exact.values.tobytes() and narrow.version == step + 1
        assert [o.to for o in out] == PEERS
        for o in out:  # the replies: the new shard, narrowed
            assert not o.snapshot and o.msg.data.dtype == w.dtype
            assert o.msg.data.tobytes() == narrowed(w, narrow.values).tobytes()
        round_trip(out)
    (pulled,) = narrow.handle(SCHED, Pull(request=1), 2.0)  # pulls (evaluation, start, rewind) stay exact
    assert pulled.snapshot and pulled.msg.data.dtype == np.float32
    assert pulled.msg.data.tobytes() == narrow.values.tobytes()


@pytest.mark.parametrize("mode", ["asp", "ssp"])
def test_asp_applies_a_float16_push_as_its_float32_values(mode):
    x0 = np.array([1, -2, 3, 0.5], np.float32)
    narrow, exact = make_core(mode=mode, n=4, init=x0, wire_dtype="float16"), make_core(mode=mode, n=4, init=x0)
    g = narrowed(F16, np.array([0.1, -0.2, 1e-5, 3.0], np.float32))
    (a,) = narrow.handle(PEERS[1], Push(rank=1, step=0, version=0, batch=8, gen=0, data=g), 0.0)
    exact.handle(PEERS[1], Push(rank=1, step=0, version=0, batch=8, gen=0, data=widened(F16, g)), 0.0)
    assert narrow.values.tobytes() == exact.values.tobytes() and narrow.version == 1
    assert a.msg.data.tobytes() == narrowed(F16, narrow.values).tobytes()


@pytest.fixture(params=NARROW, ids=lambda w: w.name)
def narrow_mid_barrier(request):
    """A BSP shard with a narrow wire, worker 1's push for step 0 pending."""
    w = request.param
    core = make_core(n=4, global_batch=12, init=[1, 2, 3, 4], wire_dtype=w.name)
    assert core.handle(PEERS[1], narrow_push(w, 1, 0, [1, 1, 1, 1]), 1.0) == []
    return w, core


@pytest.mark.parametrize("peer, make, code", [
    (PEERS[2], lambda w: Push(rank=2, step=0, version=0, batch=4, gen=0, data=np.ones(4, np.float32)), "bad_dtype"),
    (PEERS[2], lambda w: narrow_push(F16 if w is BF16 else BF16, 2, 0, [1, 1, 1, 1]), "bad_dtype"),
    (PEERS[2], lambda w: narrow_push(w, 2, 0, [1, 1, 1]), "bad_length"),
    (PEERS[1], lambda w: narrow_push(w, 1, 0, [9, 9, 9, 9]), "duplicate"),  # the pending values stay
    (PEERS[2], lambda w: narrow_push(w, 2, 0, [1, np.nan, 1, 1]), "non_finite"),
    (PEERS[2], lambda w: narrow_push(w, 2, 0, [1, 1, -np.inf, 1]), "non_finite"),
    (PEERS[2], lambda w: Push(rank=2, step=0, version=0, batch=4, gen=0,  # overflowed to inf by a sender
                              data=narrowed(w, np.array([1, 1e39 if w is BF16 else 7e4, 1, 1], np.float32))),
     "non_finite"),
])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_narrow_refusals_change_nothing(narrow_mid_barrier, peer, make, code):
    w, core = narrow_mid_barrier
    assert_refused(core, peer, make(w), code)
    for r in (0, 2):
        out = core.handle(PEERS[r], narrow_push(w, r, 0, [2, 2, 2, 2]), 2.0)
    want = make_core(n=4, global_batch=12, init=[1, 2, 3, 4])  # the step, as if the refused push never came
    for r, g in ((0, 2), (1, 1), (2, 2)):
        want.handle(PEERS[r], Push(rank=r, step=0, version=0, batch=4, gen=0, data=np.full(4, g, np.float32)), 1.0)
    assert len(out) == 3 and core.values.tobytes() == want.values.tobytes()


def test_init_is_float32_and_a_float32_job_refuses_narrow_pushes():
    core = make_core(n=3, wire_dtype="bfloat16")
    assert_refused(core, PEERS[0], Init(rank=0, data=narrowed(BF16, np.ones(3, np.float32))), "bad_dtype")
    exact = make_core(n=3, init=[1, 2, 3])
    assert_refused(exact, PEERS[1], narrow_push(BF16, 1, 0, [1, 1, 1]), "bad_dtype")
    assert_refused(exact, PEERS[1], narrow_push(F16, 1, 0, [1, 1, 1]), "bad_dtype")


def test_a_reply_after_a_restore_carries_the_restored_values():
    """Replies are narrowed once per version; a restore can bring other values at the same version."""
    a = make_core(mode="asp", n=3, init=[1, 2, 3], wire_dtype="bfloat16")
    b = make_core(mode="asp", n=3, init=[5, 6, 7], wire_dtype="bfloat16")
    for core in (a, b):
        core.handle(PEERS[1], narrow_push(BF16, 1, 0, [1, 1, 1], batch=8), 0.0)
    b.restore(a.state())
    (reply,) = b.handle(PEERS[1], Push(rank=1, step=1, version=1, batch=0, gen=0, data=np.zeros(0, np.float32)), 1.0)
    assert reply.msg.version == 1 and reply.msg.data.tobytes() == narrowed(BF16, a.values).tobytes()


# -- end to end ---------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.parametrize("mode, wire, servers", [("bsp", "bfloat16", 2), ("asp", "float16", 1)])
def test_digits_train_to_90_percent_over_a_narrow_wire(run_job, mode, wire, servers):
    """BSP also sends in 2 KiB buckets: narrow pushes and replies in parts."""
    # one recipe in both modes; ASP learns less per epoch than BSP when the workers' pushes go stale:
    # 10 epochs as in test_cluster's ASP job
    args = ["--mode", mode, "--wire-dtype", wire, "--epochs", "5" if mode == "bsp" else "10", "--dataset", "digits",
            "--model", "mlp", "--global-batch", "64", "--lr", "0.05", "--seed", "3"]
    bucket = ("--bucket-size", "2K" if mode == "bsp" else "0")
    run = run_job(args, [WorkerSpec(extra=bucket)] * 2, num_servers=servers)  # another dtype is refused: it would fail
    s = run.summary
    assert s["status"] == "completed" and s["final_test_accuracy"] >= 0.90, s
    assert json.loads((run.dir / "config.json").read_text())["wire_dtype"] == wire
    log = (run.dir / "logs" / "server0.log").read_text()
    assert f"{wire} on the wire" in log
    assert (", 0 pushes came in parts" in log) == (mode == "asp")
