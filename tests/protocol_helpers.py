"""omnips.protocol messages for tests: a hypothesis strategy and a sample for every op, comparing, mutating bytes."""

import dataclasses
import math
from dataclasses import fields

import numpy as np
from hypothesis import strategies as st

from omnips import protocol
from omnips.batching import BatchPlan
from omnips.cluster import ClusterMap, ServerStart, WorkerStart
from omnips.job import JobSpec
from omnips.sharding import shard_ranges
from omnips.protocol import (Ack, Checkpoint, Error, Failed, Heartbeat, Init, Leave, Params, Plan, Probe, Pull, Push,
                             Register, Report, Restore, Rewind, Saved, Shutdown, Welcome)

U64 = st.integers(0, 2**64 - 1)
ANY_INT = st.integers(-(2**63), 2**64 - 1)
FLOAT = st.floats(allow_nan=True, allow_infinity=True)
MEASURED = st.floats(min_value=protocol.MIN_SECONDS, max_value=protocol.MAX_SECONDS)  # a timed pass or step
WAITED = st.floats(min_value=0.0, max_value=protocol.MAX_SECONDS)
BATCH = st.integers(0, protocol.MAX_BATCH)
TEXT = st.text(max_size=20)

# msgpack-compatible plain values (lists rather than tuples, str keys); no NaN so == works
_leaf = st.one_of(st.none(), st.booleans(), ANY_INT, st.floats(allow_nan=False), TEXT, st.binary(max_size=8))
PLAIN = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(TEXT, inner, max_size=4)), max_leaves=6)
DICTS = st.dictionaries(TEXT, PLAIN, max_size=3)


@st.composite
def wire_data(draw, max_size=24):
    """float32 arrays with arbitrary bit patterns (NaN payloads, -0.0, subnormals, inf)."""
    bits = draw(st.lists(st.integers(0, 2**32 - 1), max_size=max_size))
    return np.array(bits, dtype="<u4").view("<f4")


def plans(n: int | None = None):
    """Batch plans (of `n` workers, else 1 to 6)."""
    sizes = st.lists(st.integers(0, 2**32), min_size=n or 1, max_size=n or 6).filter(any)
    return sizes.flatmap(lambda b: st.builds(BatchPlan, gen=U64, batches=st.just(tuple(b)), stop=st.booleans()))


def endpoint_pairs(k: int):
    return st.lists(st.tuples(TEXT, st.just("") | TEXT.map("ipc://".__add__)), min_size=k, max_size=k).map(tuple)


@st.composite
def welcomes(draw):
    """A welcome that fits its job: k servers' shards of the values, a rank of the role started."""
    k, n = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    job = JobSpec(num_servers=k, num_workers=n, mode=draw(st.sampled_from(["bsp", "asp", "ssp"])))
    num_params = draw(st.integers(0, 2**40))
    cluster = ClusterMap(num_params=num_params, ranges=tuple(shard_ranges(num_params, k)),
                         servers=tuple(draw(st.lists(TEXT, min_size=k, max_size=k))),
                         dead_after_s=draw(MEASURED), heartbeat_s=draw(MEASURED),
                         ipc=draw(st.just(()) | endpoint_pairs(k)))
    if draw(st.booleans()):
        start = ServerStart(num_trained=draw(st.integers(0, num_params)), checkpoint_dir=draw(TEXT),
                            restore=draw(TEXT))
        return Welcome(rank=draw(st.integers(0, k - 1)), job=job, cluster=cluster, server=start)
    start = WorkerStart(plan=draw(plans(n)), total_steps=draw(U64), join_gen=draw(st.integers(-1, 2**63 - 1)),
                        resumed=draw(st.booleans()), step=draw(U64), position=draw(U64),
                        host_workers=draw(st.integers(1, 2**63 - 1)), fingerprints=draw(st.none() | DICTS))
    return Welcome(rank=draw(st.integers(0, n - 1)), job=job, cluster=cluster, worker=start)


STRATEGIES = {
    "register": st.builds(
        Register, role=st.just("worker"), host=TEXT, endpoint=TEXT,
        capacity=st.floats(min_value=1e-300, allow_infinity=False), device=TEXT, threads=U64, pid=U64,
        memory_limit=U64)
    | st.builds(Register, role=st.just("server"), host=TEXT, endpoint=TEXT.filter(bool),
                ipc=st.just("") | TEXT.map("ipc://".__add__), capacity=st.floats(min_value=1e-300, max_value=1e300), device=TEXT, threads=U64, pid=U64),
    "welcome": welcomes(),
    "report": st.builds(Report, rank=U64, step=U64, batch=BATCH, compute_s=st.just(0.0) | MEASURED,
                        network_s=WAITED, wait_s=WAITED, loss=FLOAT, staleness=U64, mem_batch=BATCH, mem_free=U64,
                        sample_bytes=U64, done=st.booleans()),
    "probe": st.lists(st.tuples(st.integers(1, protocol.MAX_BATCH), MEASURED), min_size=2,
                      max_size=8, unique_by=lambda p: p[0]).map(
        lambda points: Probe(rank=3, batches=[b for b, _ in points], seconds=[t for _, t in points],
                             quota=len(points) / 8)),
    "heartbeat": st.just(Heartbeat())
    | st.builds(Heartbeat, echo=U64, phase=st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80),
                step=st.integers(-1, 2**63 - 1), waited_s=WAITED,
                servers=st.lists(st.integers(0, protocol.MAX_RANKS - 1), max_size=4)),
    "failed": st.builds(Failed, reason=st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1,
                                                max_size=60)),
    "shutdown": st.builds(Shutdown, ok=st.booleans(), reason=TEXT, preempted=st.booleans()),
    "leave": st.builds(Leave, why=TEXT),
    "error": st.builds(Error, code=TEXT, text=TEXT),
    "ack": st.just(Ack()),
    "init": st.builds(Init, rank=ANY_INT, data=wire_data()),
    "pull": st.builds(Pull, request=U64, at=st.none() | U64, gen=st.integers(-1, 2**64 - 1)),
    "push": st.builds(Push, rank=U64, step=U64, version=U64, batch=st.integers(1, 2**64 - 1), gen=U64,
                      data=wire_data())
    | st.builds(Push, rank=U64, step=U64, version=U64, batch=st.just(0), gen=U64, data=wire_data(max_size=0)),
    "params": st.builds(Params, request=U64, version=U64, held_s=WAITED, plan=st.none() | plans(), data=wire_data())
    | st.builds(Params, step=U64, version=U64, held_s=WAITED, plan=st.none() | plans(), data=wire_data()),
    "plan": plans().flatmap(lambda p: st.builds(Plan, plan=st.just(p), departed=st.lists(st.tuples(
        st.integers(0, len(p.batches) - 1), st.integers(-1, 2**63 - 1)), max_size=3).map(tuple))),
    "checkpoint": st.builds(Checkpoint, request=U64, step=U64, at=st.none() | U64),
    "saved": st.builds(Saved, request=U64, step=U64, version=U64, size=U64, sha256=TEXT, error=TEXT),
    "restore": st.builds(Restore, path=TEXT),
    "rewind": st.tuples(st.integers(1, 4), st.integers(1, 3)).flatmap(lambda nk: st.builds(
        Rewind, steps=st.lists(U64, min_size=nk[0], max_size=nk[0]),
        positions=st.lists(U64, min_size=nk[0], max_size=nk[0]), plan=plans(nk[0]),
        servers=st.lists(TEXT, min_size=nk[1], max_size=nk[1]).map(tuple),
        ipc=st.just(()) | endpoint_pairs(nk[1]))),
}
ANY_MESSAGE = st.one_of(*STRATEGIES.values())


def same_value(a, b) -> bool:
    """Deep equality with matching types, where NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(same_value(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def assert_same_message(got, want):
    assert type(got) is type(want)
    for f in fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if f.name == "data":
            assert a.dtype == b.dtype and a.dtype in protocol.DTYPES.values() and a.ndim == 1
            assert a.tobytes() == b.tobytes()  # bit-exact, NaN payloads included
        else:
            assert same_value(a, b), (f.name, a, b)


SAMPLE = {
    "register": Register(role="server", host="h", endpoint="tcp://h:1", ipc="ipc:///tmp/omnips-x/sock",
                         capacity=2.0, threads=4, pid=9),
    "welcome": Welcome(rank=1, job=JobSpec(num_servers=2), cluster=ClusterMap(
        num_params=5, ranges=((0, 3), (3, 5)), servers=("tcp://h:1", "tcp://h:2"), dead_after_s=30.0, heartbeat_s=1.0),
        worker=WorkerStart(plan=BatchPlan(0, (32, 32)), total_steps=10)),
    "report": Report(rank=1, step=2, batch=3, compute_s=0.5, network_s=0.5, wait_s=0.5, loss=1.0, staleness=1),
    "probe": Probe(rank=1, batches=[2, 4], seconds=[0.01, 0.015]),
    "shutdown": Shutdown(ok=True, reason="done"),
    "leave": Leave(why="SIGTERM"),
    "heartbeat": Heartbeat(echo=1, phase="waiting for servers", step=12, waited_s=1.5, servers=[1]),
    "failed": Failed(reason="worker 1 on h: its model differs from the scheduler's"),
    "error": Error(code="c", text="t"),
    "init": Init(rank=0, data=np.zeros(3, np.float32)),
    "pull": Pull(request=1, at=3),
    "push": Push(rank=1, step=2, version=2, batch=8, gen=0, data=np.zeros(3, np.float32)),
    "params": Params(step=1, version=2, held_s=0.5, plan=BatchPlan(1, (3, 5)), data=np.zeros(3, np.float32)),
    "plan": Plan(plan=BatchPlan(1, (3, 5))),
    "checkpoint": Checkpoint(request=1, step=10, at=10),
    "saved": Saved(request=1, step=10, version=10, size=100, sha256="ab" * 32),
    "restore": Restore(path="/run/checkpoints/step-10"),
    "rewind": Rewind(steps=[10, 10], positions=[640, 640], plan=BatchPlan(3, (8, 8)), servers=("tcp://h:1",),
                     ipc=(("h", "ipc:///tmp/omnips-x/sock"),)),
}


def mutate(raw: bytes, mutations) -> bytes:
    """raw with each (kind, pos, arg) of mutations applied in turn at byte pos (modulo the length): "flip" bit
    arg, "set" the byte to arg, "truncate" there, "insert" arg, "delete" the byte."""
    b = bytearray(raw)
    for kind, pos, arg in mutations:
        if not b and kind != "insert":
            continue
        i = pos % max(1, len(b))
        if kind == "flip":
            b[i] ^= 1 << arg
        elif kind == "set":
            b[i] = arg
        elif kind == "truncate":
            del b[i:]
        elif kind == "insert":
            b.insert(pos % (len(b) + 1), arg)
        else:
            del b[i]
    return bytes(b)
