"""The wire codec: round trips for every op, and refusals with stable error codes."""

import dataclasses
import math
from dataclasses import fields

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from omnips import protocol
from omnips.batching import BatchPlan
from omnips.cluster import ClusterMap, ServerStart, WorkerStart
from omnips.codec import decode, encode
from omnips.job import JobSpec
from omnips.protocol import (MAX_HEADER_BYTES, Ack, Heartbeat, Init, Params, Plan, Probe, ProtocolError, Pull, Push,
                             Report)

from protocol_helpers import ANY_MESSAGE, SAMPLE, STRATEGIES, assert_same_message, mutate

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def header_of(msg) -> dict:
    return msgpack.unpackb(encode(msg)[0], raw=False)


def frames_with(header: dict, data: bytes | None = None) -> list:
    frames = [msgpack.packb(header)]
    return frames if data is None else frames + [data]


def refused(frames) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    return info.value


# -- round trips ---------------------------------------------------------------------


def test_every_op_has_a_strategy():
    assert set(STRATEGIES) == set(protocol.OPS)


@pytest.mark.parametrize("op", sorted(protocol.OPS))
@FAST
@given(data=st.data())
def test_round_trip(op, data):
    msg = data.draw(STRATEGIES[op])
    frames = encode(msg)
    assert len(frames) == (2 if msg.HAS_DATA else 1)
    header = msgpack.unpackb(frames[0], raw=False)
    assert header["v"] == protocol.VERSION and header["op"] == op
    if msg.HAS_DATA:
        assert header["dt"] == "f4" and header["len"] == msg.data.size
        if msg.data.size:
            assert np.shares_memory(np.asarray(frames[1]), msg.data)  # sent without a copy
        # what a receiver gets: its own bytes for each frame
        frames = [bytes(frames[0]), bytes(frames[1])]
    else:
        frames = [bytes(frames[0])]
    assert_same_message(decode(frames), msg)


@FAST
@given(msg=st.one_of(STRATEGIES["init"], STRATEGIES["push"], STRATEGIES["params"]))
def test_decoded_data_is_a_zero_copy_view_of_the_frame(msg):
    head, body = encode(msg)
    frame = bytearray(bytes(body))  # a writable receive buffer
    got = decode([bytes(head), frame])
    assert got.data.size == msg.data.size
    if got.data.size:
        assert np.shares_memory(got.data, np.frombuffer(frame, dtype=np.uint8))
        frame[0:4] = np.array([1234.5], dtype="<f4").tobytes()
        assert got.data[0] == np.float32(1234.5)  # the array *is* the frame's bytes


def test_decode_accepts_zmq_like_frames_with_a_buffer_attribute():
    class Frame:
        def __init__(self, b):
            self.buffer = memoryview(b)

    msg = Push(rank=1, step=2, version=3, batch=4, gen=5, data=np.arange(3, dtype="<f4"))
    got = decode([Frame(bytes(f)) for f in encode(msg)])
    assert_same_message(got, msg)


@pytest.mark.parametrize("tag", sorted(protocol.DTYPES))
@FAST
@given(bits=st.lists(st.integers(0, 2**32 - 1), max_size=24))
def test_every_wire_dtype_round_trips_bit_exact(tag, bits):
    dtype = protocol.DTYPES[tag]
    data = np.array(bits, dtype="<u4").astype(f"<u{dtype.itemsize}").view(dtype)
    for msg in (Push(rank=1, step=2, version=2, batch=3, gen=0, data=data),
                Params(request=1, version=2, held_s=0.0, plan=None, data=data)):
        head, body = encode(msg)
        header = msgpack.unpackb(head, raw=False)
        assert header["dt"] == tag and header["len"] == data.size and len(bytes(body)) == data.size * dtype.itemsize
        got = decode([bytes(head), bytes(body)])
        assert got.data.dtype == dtype and got.data.tobytes() == data.tobytes()


def test_encode_refuses_non_wire_arrays():
    for bad in (np.zeros(3, dtype=np.float64), np.zeros((2, 2), dtype=np.float32),
                np.zeros(6, dtype=np.float32)[::2], np.zeros(3, dtype=">f4"), np.zeros(3, dtype=">f2"),
                np.zeros(3, dtype=">u2"), np.zeros(3, dtype=np.int16), np.zeros(3, dtype=np.uint32)):
        with pytest.raises(ValueError):
            encode(Init(rank=0, data=bad))


def test_optional_fields_take_their_defaults():
    got = decode(frames_with({"v": protocol.VERSION, "op": "report", "rank": 1, "step": 2, "batch": 3, "compute_s": 0.5,
                              "network_s": 0.25, "wait_s": 0, "loss": 1.5}))
    assert got == Report(rank=1, step=2, batch=3, compute_s=0.5, network_s=0.25, wait_s=0, loss=1.5,
                         staleness=0, done=False)
    assert decode(frames_with({"v": protocol.VERSION, "op": "pull", "request": 7})) == Pull(request=7, at=None)
    # a field whose default is made fresh for each message is optional too
    plan = decode(frames_with({"v": protocol.VERSION, "op": "plan", "plan": {"gen": 2, "batches": [3, 4]}}))
    assert plan == Plan(plan=BatchPlan(gen=2, batches=(3, 4), stop=False), departed=())


# -- refusals ------------------------------------------------------------------------


def test_no_frames():
    assert refused([]).code == "empty"


@FAST
@given(raw=st.binary(max_size=64))
def test_random_bytes_as_header_are_refused(raw):
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:
        header = None
    assume(not (isinstance(header, dict) and header.get("v") == protocol.VERSION and isinstance(header.get("op"), str)
                and header["op"] in protocol.OPS))
    assert refused([raw]).code in ("bad_header", "version", "bad_op")


@pytest.mark.parametrize("value", [[1, 2], 3, "ack", None, True, 1.5, b"\x81"])
def test_header_must_be_a_map(value):
    assert refused([msgpack.packb(value)]).code == "bad_header"


def test_header_with_trailing_bytes_or_non_text_keys_is_refused():
    good = msgpack.packb({"v": protocol.VERSION, "op": "ack"})
    assert decode([good]) == Ack()
    assert refused([good + b"\x00"]).code == "bad_header"
    assert refused([good[:-1]]).code == "bad_header"
    assert refused([msgpack.packb({1: 1, "v": protocol.VERSION, "op": "ack"})]).code == "bad_header"


@pytest.mark.parametrize("v", [0, protocol.VERSION - 1, protocol.VERSION + 1, -1, str(protocol.VERSION), None,
                               [protocol.VERSION], 2**64 - 1])
def test_wrong_version(v):
    assert refused(frames_with({"v": v, "op": "ack"})).code == "version"


def test_missing_version():
    assert refused(frames_with({"op": "ack"})).code == "version"


@pytest.mark.parametrize("v", [True, 1.0])
def test_version_must_be_an_integer(v, monkeypatch):
    monkeypatch.setattr(protocol, "VERSION", 1)  # both equal 1: only their type tells them from the version
    assert refused(frames_with({"v": v, "op": "ack"})).code == "version"


@pytest.mark.parametrize("op", ["nope", "", "ACK", 5, None, True, b"ack"])
def test_unknown_op(op):
    assert refused(frames_with({"v": protocol.VERSION, "op": op})).code == "bad_op"


def test_missing_op():
    assert refused(frames_with({"v": protocol.VERSION})).code == "bad_op"


@pytest.mark.parametrize("op", [["push"], {"a": 1}])
def test_unhashable_op_is_refused(op):
    assert refused(frames_with({"v": protocol.VERSION, "op": op})).code == "bad_op"


@pytest.mark.parametrize("msg, frame_count", [
    (Ack(), 2), (Heartbeat(), 3), (Pull(request=1), 2),
    (Push(rank=0, step=0, version=0, batch=1, gen=0, data=np.zeros(2, np.float32)), 1),
    (Push(rank=0, step=0, version=0, batch=1, gen=0, data=np.zeros(2, np.float32)), 3),
    (Init(rank=0, data=np.zeros(2, np.float32)), 1),
    (Params(request=0, version=0, held_s=0.0, plan=None, data=np.zeros(2, np.float32)), 1),
])
def test_wrong_frame_count(msg, frame_count):
    frames = [bytes(f) for f in encode(msg)]
    frames = (frames + [bytes(8)] * 3)[:frame_count]
    assert refused(frames).code == "bad_frames"


def _required(cls):
    from dataclasses import MISSING
    return [f.name for f in fields(cls) if f.name != "data" and f.default is MISSING
            and f.default_factory is MISSING]


MISSABLE = [(op, name) for op, cls in sorted(protocol.OPS.items()) for name in _required(cls)]


@pytest.mark.parametrize("op, name", MISSABLE)
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_missing_field(op, name, data):
    msg = data.draw(STRATEGIES[op])
    frames = [bytes(f) for f in encode(msg)]
    header = msgpack.unpackb(frames[0], raw=False)
    del header[name]
    frames[0] = msgpack.packb(header)
    err = refused(frames)
    assert err.code == "bad_field" and name in err.text


RECORD = [[], "x", 1, None, b"x"]
WRONG = {  # field type -> values of other types
    int: [True, False, "1", 1.5, None, [1], {"a": 1}, b"1"],
    float: [True, "0.5", None, [0.5], b"x"],
    str: [1, 1.5, None, True, b"bytes", ["s"]],
    bool: [1, 0, "true", None, 1.0],
    dict: [[], "x", 1, None, b"x"],
    list: [{}, "x", 1, None, b"x"],
    int | None: ["1", 1.5, True, [], b"1"],
    dict | None: [[], "x", 1, True],
    BatchPlan: RECORD, JobSpec: RECORD, ClusterMap: RECORD,
    BatchPlan | None: [[], "x", 1, True], ServerStart | None: [[], "x", 1, True], WorkerStart | None: [[], 1, True],
    tuple[int, ...]: [{}, "x", 1, None, ["1"], [True], [1.5]],
    tuple[str, ...]: [{}, "x", 1, None, [1], [None]],
    tuple[tuple[int, int], ...]: [{}, "x", [1], [[1]], [[1, 2, 3]], [[1, "2"]]],
    tuple[tuple[str, str], ...]: [{}, "x", ["a"], [["a"]], [["a", 1]]],
}


def _paths(obj, path=()):
    """(path, type) of every field of `obj` but its data, and of the records inside it."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name != "data":
            yield path + (f.name,), f.type
        if dataclasses.is_dataclass(value):
            yield from _paths(value, path + (f.name,))


MISTYPED = [(op, ".".join(path), bad) for op, msg in sorted(SAMPLE.items()) for path, tp in _paths(msg)
            for bad in WRONG[tp]]


@pytest.mark.parametrize("op, path, bad", MISTYPED)
def test_wrong_field_type(op, path, bad):
    """Every field, also those of a record inside a message (welcome.cluster.ranges), is
    refused with a value of another type, and the refusal names it."""
    frames = [bytes(f) for f in encode(SAMPLE[op])]
    assert isinstance(decode(frames), type(SAMPLE[op]))  # the unmodified sample is fine
    header = msgpack.unpackb(frames[0], raw=False)
    *outer, name = path.split(".")
    inner = header
    for key in outer:
        inner = inner[key]
    inner[name] = bad
    frames[0] = msgpack.packb(header)
    err = refused(frames)
    assert err.code == "bad_field" and f"{op}.{path}" in err.text, err.text


def test_ints_are_accepted_for_float_fields():
    msg = decode(frames_with({"v": protocol.VERSION, "op": "params", "request": 1, "version": 2, "held_s": 3, "plan": None,
                              "dt": "f4", "len": 0}, b""))
    assert msg.held_s == 3


@pytest.mark.parametrize("dt", ["f8", "<f4", "float32", "F4", 4, None, b"f4", "bfloat16", "float16", "BF16", "u2",
                                "<f2", "f2 ", b"bf16", ["bf16"]])
def test_bad_dtype(dt):
    header = header_of(SAMPLE["push"])
    header["dt"] = dt
    assert refused(frames_with(header, bytes(12))).code == "bad_dtype"


def test_missing_dtype():
    header = header_of(SAMPLE["init"])
    del header["dt"]
    assert refused(frames_with(header, bytes(12))).code == "bad_dtype"


@FAST
@given(n=st.integers(0, 50), nbytes=st.integers(0, 220))
def test_data_length_must_match_the_header(n, nbytes):
    header = header_of(SAMPLE["push"])
    header["len"] = n
    frames = frames_with(header, bytes(nbytes))
    if nbytes == 4 * n:
        assert decode(frames).data.size == n
    else:
        assert refused(frames).code == "bad_length"


@pytest.mark.parametrize("tag", ["bf16", "f2"])
@FAST
@given(n=st.integers(0, 50), nbytes=st.integers(0, 220))
def test_a_two_byte_tag_needs_two_bytes_per_item(tag, n, nbytes):
    header = header_of(SAMPLE["params"])
    header.update(dt=tag, len=n)
    frames = frames_with(header, bytes(nbytes))
    if nbytes == 2 * n:
        assert decode(frames).data.dtype == protocol.DTYPES[tag]
    else:
        err = refused(frames)
        assert err.code == "bad_length" and tag in err.text


@pytest.mark.parametrize("n", [-1, -(2**63), True, 1.0, "3", None])
def test_data_length_must_be_a_count(n):
    header = header_of(SAMPLE["init"])
    header["len"] = n
    assert refused(frames_with(header, bytes(4))).code == "bad_field"


def test_missing_data_length():
    header = header_of(SAMPLE["params"])
    del header["len"]
    assert refused(frames_with(header, bytes(12))).code == "bad_field"


@pytest.mark.parametrize("op, name, value", [
    ("push", "rank", -1), ("push", "step", -1), ("push", "version", -1), ("push", "gen", -1),
    ("push", "batch", 0), ("push", "batch", -5),
    ("report", "rank", -1), ("report", "step", -1), ("report", "batch", -1), ("report", "compute_s", -0.5), ("report", "wait_s", math.nan),
    ("report", "network_s", -1e-9), ("report", "wait_s", -1), ("report", "staleness", -1),
    ("report", "mem_free", -1), ("report", "sample_bytes", -1), ("register", "memory_limit", -1),
    ("register", "threads", -2), ("register", "pid", -1),
    ("probe", "rank", -1), ("probe", "batches", [2]), ("probe", "batches", [2, 2]), ("probe", "batches", [0, 4]),
    ("probe", "seconds", [0.01]), ("probe", "seconds", [0.01, 0.0]), ("probe", "seconds", [0.01, math.inf]),
    ("probe", "seconds", [0.01, math.nan]), ("probe", "seconds", [0.01, 1]), ("probe", "batches", list(range(1, 10))),
    ("probe", "mem_free", -1), ("probe", "sample_bytes", -1), ("probe", "spread", -0.1),
    ("probe", "spread", math.nan), ("probe", "spread", math.inf), ("probe", "spread", "wide"),
    # no timer reads a subnormal time (it made a time model's slope 0 and failed the job), nor
    # 11 days for a pass; no pass holds 2**31 samples
    ("probe", "seconds", [0.01, 5e-324]), ("probe", "seconds", [0.01, 1e308]), ("probe", "batches", [1, 2 ** 63]),
    ("report", "compute_s", 1e-310), ("report", "compute_s", 2e6), ("report", "network_s", 1e300),
    ("report", "wait_s", 1e300), ("report", "overhead_s", -0.1), ("report", "overhead_s", math.nan),
    ("report", "batch", 2 ** 31 + 1), ("report", "mem_batch", 2 ** 63),
    ("params", "held_s", -1.0), ("params", "held_s", math.nan), ("params", "held_s", 1e300), ("params", "version", -1),
    ("pull", "at", -1), ("pull", "gen", -2),
    ("plan", "plan.gen", -1), ("plan", "plan.batches", [0, 0]), ("plan", "plan.batches", [3, -1]),
    ("plan", "plan.batches", []), ("params", "plan.gen", -1), ("params", "plan.batches", [0, 0]),
    ("params", "request", 1), ("params", "step", -2), ("params", "request", -2),
    ("plan", "departed", [[5, 1]]), ("plan", "departed", [[0]]), ("plan", "departed", [[0, -2]]), ("plan", "departed", [[0, 1.5]]),
    ("pull", "at", -1), ("checkpoint", "step", -1), ("checkpoint", "at", -1), ("saved", "step", -1),
    ("saved", "version", -1), ("saved", "size", -1), ("rewind", "steps", [-1, 2]), ("rewind", "positions", [1]),
    ("rewind", "servers", []), ("rewind", "plan.batches", [8]), ("rewind", "plan.batches", [8, 8, 8]),
    ("rewind", "servers", [1]),
    # a welcome that does not fit its job (SAMPLE's: a worker's, 2 workers, 2 servers, 5 values)
    ("welcome", "rank", 2), ("welcome", "rank", -1), ("welcome", "cluster.ranges", [[0, 3], [3, 4]]),
    ("welcome", "cluster.ranges", [[0, 5]]), ("welcome", "cluster.ranges", [[3, 5], [0, 3]]),
    ("welcome", "cluster.ranges", [[0, 3], [3, 5], [5, 5]]), ("welcome", "cluster.ranges", [[0, 3], [3, 10 ** 12]]),
    ("welcome", "cluster.num_params", 6), ("welcome", "cluster.num_params", -1), ("welcome", "cluster.servers", ["a"]),
    ("welcome", "cluster.ipc", [["h", "tcp://h:2"], ["h", ""]]), ("welcome", "cluster.ipc", [["h", ""]]),
    ("welcome", "cluster.dead_after_s", 0.0), ("welcome", "cluster.heartbeat_s", math.nan),
    ("welcome", "worker.plan", {"gen": 0, "batches": [1, 2, 3]}), ("welcome", "worker.plan", {"gen": 0, "batches": [0, 0]}),
    ("welcome", "worker.join_gen", -2), ("welcome", "worker.host_workers", 0), ("welcome", "worker.step", -1),
    ("welcome", "worker", None), ("welcome", "server", {"num_trained": 0, "checkpoint_dir": ""}),
    ("welcome", "job.mode", "xsp"), ("welcome", "job.num_servers", 0), ("welcome", "job.min_batch", 40),
    ("rewind", "ipc", [["h", "ipc://a"], ["h", "ipc://b"]]), ("rewind", "ipc", [["h"]]),
    ("rewind", "ipc", [["h", "tcp://h:2"]]), ("rewind", "ipc", [["h", 1]]), ("register", "ipc", "tcp://h:2"),
    ("register", "role", "boss"), ("register", "capacity", 0.0), ("register", "capacity", -1.0),
    ("register", "capacity", math.nan), ("register", "capacity", math.inf), ("register", "endpoint", ""),
    ("heartbeat", "echo", -1), ("heartbeat", "step", -2), ("heartbeat", "waited_s", -1.0),
    ("heartbeat", "waited_s", math.nan), ("heartbeat", "waited_s", 1e300), ("heartbeat", "servers", [-1]),
    ("heartbeat", "servers", [4096]), ("heartbeat", "servers", [0.5]), ("heartbeat", "servers", [0] * 4097),
    ("heartbeat", "phase", "x" * 81), ("heartbeat", "phase", "two\nlines"), ("failed", "reason", ""),
    ("failed", "reason", "x" * 2001), ("failed", "reason", "a\rb"),
])
def test_out_of_range_values(op, name, value):
    """Each refusal is one line naming the field (a record's field by its path: plan.gen)."""
    frames = [bytes(f) for f in encode(SAMPLE[op])]
    header = msgpack.unpackb(frames[0], raw=False)
    *outer, last = name.split(".")
    inner = header
    for key in outer:
        inner = inner[key]
    inner[last] = value
    frames[0] = msgpack.packb(header)
    err = refused(frames)
    assert err.code == "bad_field" and (last in err.text or last.replace("_", "-") in err.text), err.text
    assert "\n" not in err.text and len(err.text) < 300


@pytest.mark.parametrize("op, name", [("ack", "v"), ("ack", "op"), ("push", "dt"), ("push", "len"),
                                      ("register", "role")])
@pytest.mark.parametrize("value", ["x" * 500_000, b"\x00" * 500_000, [[["x" * 100] * 20] * 20] * 20])
def test_refusals_do_not_echo_what_was_sent(op, name, value):
    """A refusal's text is logged and sent back: it must not repeat a huge field."""
    header = header_of(SAMPLE.get(op, Ack()))
    header[name] = value
    frames = frames_with(header, bytes(12) if op == "push" else None)
    assert len(frames[0]) <= MAX_HEADER_BYTES
    err = refused(frames)
    assert len(err.text) < 1000, (err.code, len(err.text))


def test_header_size_limit():
    base = {"v": protocol.VERSION, "op": "ack"}

    def header_of_size(size):  # a str32 pad: its prefix has the same length for every size used here
        overhead = len(msgpack.packb({**base, "pad": "x" * 70000})) - 70000
        raw = msgpack.packb({**base, "pad": "x" * (size - overhead)})
        assert len(raw) == size
        return raw

    assert decode([header_of_size(MAX_HEADER_BYTES)]) == Ack()  # the limit itself is allowed
    assert refused([header_of_size(MAX_HEADER_BYTES + 1)]).code == "bad_header"
    assert refused([bytes(MAX_HEADER_BYTES + 1)]).code == "bad_header"


# -- mutated encodings ---------------------------------------------------------------


MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.just(0)),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=ANY_MESSAGE, mutations=st.lists(MUTATION, min_size=1, max_size=3))
@example(msg=Ack(), mutations=[("truncate", 3, 0)])
@example(msg=Pull(request=1), mutations=[("set", 1, 0x02)])
def test_mutated_header_is_refused_or_valid(msg, mutations):
    frames = [bytes(f) for f in encode(msg)]
    frames[0] = mutate(frames[0], mutations)
    try:
        got = decode(frames)
    except ProtocolError as exc:
        assert exc.code in ("bad_header", "version", "bad_op", "bad_frames", "bad_field", "bad_dtype",
                            "bad_length")
        return
    # whatever came through is a well-formed message that survives its own round trip
    assert isinstance(got, protocol.Message) and type(got) is protocol.OPS[got.OP]
    got.check()
    assert_same_message(decode([bytes(f) for f in encode(got)]), got)


def test_the_bounds_themselves_are_accepted():
    for msg in (Report(rank=0, step=0, batch=protocol.MAX_BATCH, compute_s=protocol.MIN_SECONDS, network_s=0.0,
                       wait_s=protocol.MAX_SECONDS, loss=0.0, mem_batch=protocol.MAX_BATCH),
                Report(rank=0, step=0, batch=0, compute_s=0.0, network_s=1e-12, wait_s=0.0, loss=0.0),
                Probe(rank=0, batches=[1, protocol.MAX_BATCH], seconds=[protocol.MIN_SECONDS, protocol.MAX_SECONDS])):
        assert_same_message(decode([bytes(f) for f in encode(msg)]), msg)


def test_a_peer_speaking_an_older_protocol_is_told_the_versions():
    """Protocol 3 renamed fields and typed the plan, welcome and cluster map, and 4 added a
    report's overhead_s: a process of a version before is refused before any of its fields is read."""
    err = refused(frames_with({"v": 2, "op": "push", "rank": 1, "step": 0, "ver": 0, "batch": 4, "gen": 0}))
    assert (err.code, err.text) == ("version", "protocol version 2, this process speaks 4")
    err = refused(frames_with({"v": 3, "op": "report", "rank": 0, "step": 0, "batch": 4, "compute_s": 0.1,
                               "network_s": 0.0, "wait_s": 0.0, "loss": 1.0}))
    assert (err.code, err.text) == ("version", "protocol version 3, this process speaks 4")
