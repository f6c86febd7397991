"""Fuzzing: mutated messages at the codec, hostile traffic at the shard core and the
registry, and at every listening socket of a running BSP job.

The properties: `decode` returns a well-formed message or raises ProtocolError,
nothing else; a refused message changes no state; the legitimate traffic around
hostile messages has exactly the outcome it has without them.
"""

import dataclasses
import math
import random
import struct
import time
from collections import Counter
from dataclasses import dataclass, fields

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from omnips import codec, protocol
from omnips.batching import BatchPlan
from omnips.job import JobSpec
from omnips.launch import WorkerSpec
from omnips.metrics import read_events
from omnips.protocol import (Ack, Checkpoint, Error, Failed, Heartbeat, Init, Params, Plan, ProtocolError, Pull, Push,
                             Register, Report, Shutdown)
from omnips.sharding import shard_ranges
from omnips.scheduler.registry import Registry
from omnips.server.shard import ShardCore

from helpers import finish, start_cluster, wait_for_event
from protocol_helpers import ANY_MESSAGE, SAMPLE, TEXT, U64, assert_same_message, mutate
from shard_helpers import PEERS, assert_same_state, round_trip, snapshot

# -- the mutation engine -------------------------------------------------------------
#
# Mutations work on a message's structure (the header's key/value pairs and the
# frames) rather than on bytes only, so that most mutants get past msgpack and reach
# the field checks. The engine draws from a `random.Random`: hypothesis supplies one
# below, the end-to-end attack a seeded one.

REFUSAL_CODES = {"empty", "bad_header", "version", "bad_op", "bad_frames", "bad_field", "bad_dtype", "bad_length"}
KEYS = sorted({"v", "op", "dt", "len"} | {f.name for cls in protocol.OPS.values() for f in fields(cls)} - {"data"})


@dataclass(frozen=True)
class Raw:
    """Bytes spliced into a header as they are: msgpack that no encoder writes."""

    data: bytes


RAW_VALUES = [
    Raw(b"\xa2\xff\xfe"),  # a str that is not UTF-8
    Raw(b"\xc1"),  # the one byte msgpack never uses
    Raw(b"\xdd\xff\xff\xff\xff"),  # an array that claims 2**32 - 1 items and holds none
    Raw(b"\xdf\xff\xff\xff\xff"),  # the same for a map
    Raw(b"\xdb\x7f\xff\xff\xff"),  # a str that claims 2 GiB
    Raw(b"\xcf\x00\x01"),  # a truncated uint64
    Raw(b"\x81\x01\x02"),  # a map with an int key
    Raw(b"\x81\xc0\x02"),  # a map with a nil key
    Raw(b"\xd4\x05\x00"),  # an ext type
    Raw(b"\xd6\xff\x00\x00\x00\x01"),  # a timestamp
    Raw(b"\xc7\x03\xff\x00\x00\x00"),  # a timestamp of impossible length
    Raw(b"\xc4\x04ab"),  # bin that ends early
]
EXTREMES = [-1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 0, 1, 1e308, -1e308, math.inf, -math.inf, math.nan, -0.0,
            5e-324, True, False, None, "", b"", [], {}]
PLAUSIBLE = [*protocol.OPS, "f4", "f8", "worker", "server", "tcp://127.0.0.1:1", 0.5, [16, 16], {"gen": 1},
             {"range": [0, 3]}]


def hostile_value(rng):
    kind = rng.randrange(8)
    if kind == 0:
        return rng.choice(EXTREMES)
    if kind == 1:
        return rng.choice(RAW_VALUES)
    if kind == 2:
        return rng.choice([rng.randint(-(2**63), 2**64 - 1), rng.randint(-3, 3)])
    if kind == 3:  # any bit pattern: NaN payloads, subnormals, infinities
        return struct.unpack("<d", rng.randbytes(8))[0]
    if kind == 4:  # nested containers
        value = rng.choice([0, "x", None])
        for _ in range(rng.randint(1, 120)):
            value = [value] if rng.random() < 0.5 else {"k": value}
        return value
    if kind == 5:  # long strings and bytes, up to past the header limit
        size = rng.choice([1000, 70_000, protocol.MAX_HEADER_BYTES])
        return "x" * size if rng.random() < 0.5 else b"\x00" * size
    if kind == 6:
        return rng.choice([msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 9))),
                           msgpack.Timestamp(rng.randint(0, 2**32 - 1), rng.randint(0, 999_999_999))])
    return rng.choice(PLAUSIBLE)


def _packed(value) -> bytes:
    if isinstance(value, Raw):
        return value.data
    if isinstance(value, list):  # it may hold Raw items
        return msgpack.Packer().pack_array_header(len(value)) + b"".join(_packed(v) for v in value)
    return msgpack.packb(value)


class Draft:
    """A message taken apart: header pairs (duplicates allowed), or a header that is
    not a map, or raw header bytes; then the frames after the header."""

    def __init__(self, msg: protocol.Message):
        head, *self.rest = [bytes(f) for f in codec.encode(msg)]
        self.pairs = list(msgpack.unpackb(head, raw=False).items())
        self.whole = None  # a header that replaces the map
        self.head = None  # header bytes that replace everything above

    def header(self) -> bytes:
        if self.head is not None:
            return self.head
        if self.whole is not None:
            return _packed(self.whole)
        return msgpack.Packer().pack_map_header(len(self.pairs)) + \
            b"".join(_packed(k) + _packed(v) for k, v in self.pairs)

    def frames(self) -> list[bytes]:
        return [self.header(), *self.rest]

    def index(self, key):
        """The position of `key`'s (first) pair, added if missing."""
        for i, (k, _) in enumerate(self.pairs):
            if k == key:
                return i
        self.pairs.append((key, None))
        return len(self.pairs) - 1


def m_drop(rng, d):
    if d.pairs:
        return f"drop {d.pairs.pop(rng.randrange(len(d.pairs)))[0]!r}"


def m_set(rng, d):
    key = rng.choice([k for k, _ in d.pairs] or KEYS) if rng.random() < 0.8 else rng.choice(KEYS)  # mostly its own
    i = d.index(key)
    d.pairs[i] = (key, hostile_value(rng))
    return f"set {key!r} = {d.pairs[i][1]!r:.60}"


def m_add(rng, d):
    key = rng.choice(["x", "", "\u00e9t\u00e9", "V", "data", "op ", rng.choice(KEYS) + "_"])
    d.pairs.append((key, hostile_value(rng)))
    return f"add {key!r}"


def m_duplicate_key(rng, d):  # msgpack keeps the last of duplicate keys
    if d.pairs:
        key = rng.choice(d.pairs)[0]
        d.pairs.append((key, hostile_value(rng)))
        return f"duplicate key {key!r}"


def m_swap(rng, d):
    if len(d.pairs) >= 2:
        i, j = rng.sample(range(len(d.pairs)), 2)
        (ki, vi), (kj, vj) = d.pairs[i], d.pairs[j]
        d.pairs[i], d.pairs[j] = (ki, vj), (kj, vi)
        return f"swap {ki!r} and {kj!r}"


def m_op(rng, d):  # another op's name over this op's fields
    op = rng.choice([*protocol.OPS, "PUSH", "push\x00", ""])
    d.pairs[d.index("op")] = ("op", op)
    return f"op {op!r}"


def m_key_type(rng, d):
    if d.pairs:
        i = rng.randrange(len(d.pairs))
        key, value = d.pairs[i]
        new = rng.choice([key.encode() if isinstance(key, str) else b"k", 1, -1, Raw(b"\xc0"), Raw(b"\x91\x01")])
        d.pairs[i] = (new, value)
        return f"key {key!r} -> {new!r}"


def m_not_a_map(rng, d):
    d.whole = rng.choice([[v for _, v in d.pairs], [k for k, _ in d.pairs], hostile_value(rng)])
    return "header is not a map"


def m_raw_header(rng, d):
    d.head = rng.choice([b"", rng.randbytes(rng.randint(1, 64)), b"\x80", b"\x81\xa1v\x01"])
    return f"raw header {d.head[:16]!r}"


def m_frames(rng, d):
    kind = rng.randrange(6)
    if kind == 0:
        d.rest = []
    elif kind == 1:
        d.rest.append(rng.choice([b"", rng.randbytes(rng.randint(1, 64)), bytes(d.header())]))
    elif kind == 2 and d.rest:  # truncate
        d.rest[0] = d.rest[0][:rng.randrange(len(d.rest[0]) + 1)]
    elif kind == 3:  # extend, by whole float32s or not
        d.rest = [(d.rest[0] if d.rest else b"") + rng.randbytes(rng.choice([1, 3, 4, 8, 4096]))]
    elif kind == 4:
        d.rest = [d.header(), *d.rest]  # a header where the data belongs
    else:  # a data frame for an op that takes none, or a second one
        d.rest = [*d.rest, np.zeros(rng.randint(0, 4), "<f4").tobytes()]
    return f"frames: kind {kind}, {len(d.rest)} after the header"


def m_dtype(rng, d):
    dt = rng.choice(["f8", "<f4", "float32", "F4", b"f4", 4, None, "f4 "])
    d.pairs[d.index("dt")] = ("dt", dt)
    return f"dt {dt!r}"


def m_length(rng, d):
    n = rng.choice([-1, 2**64 - 1, 2**62, 0, 1, 1.0, "3", None, rng.randint(0, 100)])
    d.pairs[d.index("len")] = ("len", n)
    return f"len {n!r}"


def m_bytes(rng, d):  # last resort: bit flips and splices, header or data
    cut = [(rng.choice(["flip", "set", "truncate", "insert", "delete"]), rng.randrange(10**6), rng.randrange(8))
           for _ in range(rng.randint(1, 3))]
    if d.rest and rng.random() < 0.3:
        d.rest[0] = mutate(d.rest[0], cut)
    else:
        d.head = mutate(d.header(), cut)
    return f"bytes {cut}"


STRUCTURAL = [m_drop, m_set, m_set, m_add, m_duplicate_key, m_swap, m_op, m_key_type, m_frames, m_dtype, m_length]
ENDINGS = [m_not_a_map, m_raw_header, m_bytes]  # each leaves no map to mutate further


def mutated(msg: protocol.Message, rng, count: int) -> tuple[list[bytes], list[str]]:
    """`msg`'s frames after `count` mutations, and what they were."""
    d, done = Draft(msg), []
    for k in range(count):
        last = k == count - 1
        mutation = rng.choice(STRUCTURAL + ENDINGS if last else STRUCTURAL)
        done.append(mutation(rng, d) or f"{mutation.__name__}: nothing to do")
    return d.frames(), done


def decode_or_refuse(frames) -> protocol.Message | ProtocolError:
    """decode's contract: a well-formed message that survives its own round trip, or
    ProtocolError with a known code; never any other exception."""
    try:
        got = codec.decode(frames)
    except ProtocolError as exc:
        assert exc.code in REFUSAL_CODES, exc
        assert len(exc.text) < 1000, exc.code  # it is logged and sent back
        return exc
    assert type(got) is protocol.OPS[got.OP]
    header = msgpack.unpackb(codec.encode(got)[0], raw=False)  # each field as it travels passes its type test
    for f in fields(got):
        value = getattr(got, f.name)
        if f.name == "data":
            assert value.dtype == np.dtype("<f4") and value.ndim == 1
        else:
            assert codec.type_ok(header[f.name], f.type), (f.name, value)
            assert not dataclasses.is_dataclass(f.type) or isinstance(value, f.type), (f.name, value)  # typed
    got.check()
    assert_same_message(codec.decode([bytes(f) for f in codec.encode(got)]), got)
    return got


# -- 1. the decoder ------------------------------------------------------------------


@pytest.mark.slow  # 400 mutated messages (test_each_mutation_alone_on_each_op stays in the default tier)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(msg=ANY_MESSAGE, rng=st.randoms(use_true_random=False), count=st.integers(1, 4))
def test_mutated_messages_decode_or_are_refused(msg, rng, count):
    frames, done = mutated(msg, rng, count)
    note(f"{msg.OP}: {done}")
    got = decode_or_refuse(frames)
    event(got.code if isinstance(got, ProtocolError) else "decoded")


@pytest.mark.parametrize("op", sorted(SAMPLE))
def test_each_mutation_alone_on_each_op(op):
    """Every mutation on every op, whatever the draws above happen to favour."""
    rng = random.Random(op)
    for mutation in STRUCTURAL + ENDINGS:
        for _ in range(20):
            d = Draft(SAMPLE[op])
            mutation(rng, d)
            decode_or_refuse(d.frames())


# -- 2. the shard core: hostile messages among legitimate traffic --------------------

ATTACKER = b"attacker"
# ops a shard does not take (checkpoint requests it takes, like pulls: from whoever reaches its port)
OTHER_OPS = [Heartbeat(), Ack(), *(m for m in SAMPLE.values() if not isinstance(m, (Push, Pull, Init, Checkpoint)))]
PUSH_KINDS = ["bad_rank", "rank_taken", "bad_length", "bad_version", "bad_step", "duplicate", "non_finite",
              "reply_held"]
KINDS = [*PUSH_KINDS, "init", "pull_passed", "pull", "other_op"]


@dataclass(frozen=True)
class ShardCase:
    workers: int
    n: int
    lo: int
    num_trained: int
    batches: tuple
    steps: int  # per worker
    choices: tuple  # which ready worker sends next
    seed: int


@st.composite
def shard_cases(draw):
    workers = draw(st.integers(2, 3))
    n = draw(st.integers(0, 6))
    lo = draw(st.integers(0, 3))
    steps = draw(st.integers(1, 4))
    return ShardCase(workers, n, lo, lo + draw(st.integers(0, n)),
                     tuple(draw(st.lists(st.integers(1, 16), min_size=workers, max_size=workers))), steps,
                     tuple(draw(st.lists(st.integers(0, 5), min_size=workers * steps, max_size=workers * steps))),
                     draw(st.integers(0, 2**31)))


HOSTILE = st.lists(st.tuples(st.integers(0, 13), st.sampled_from(KINDS), st.integers(0, 2**16),
                             st.integers(0, 2**16)), min_size=4, max_size=30)


class ShardDrive:
    """Workers 0..N-1 (peers PEERS) run `case` against a fresh core: worker 0 sends
    the init, then each ready worker (the one `case.choices` picks) pushes its next
    step, as real workers do; the hostile messages go in before the legitimate event
    at their position. Records every reply to the workers, bit for bit."""

    def __init__(self, mode: str, case: ShardCase, values_at: dict | None = None):
        self.mode, self.case = mode, case
        job = JobSpec(mode=mode, num_workers=case.workers, global_batch=sum(case.batches), lr=0.1, momentum=0.9,
                      weight_decay=0.01, staleness=1)
        self.core = ShardCore(job, case.lo, case.lo + case.n, case.num_trained)
        rng = np.random.default_rng(case.seed)
        self.x0 = rng.standard_normal(case.n).astype(np.float32)
        self.grads = rng.standard_normal((case.workers, case.steps, case.n)).astype(np.float32)
        self.peers = PEERS[:case.workers]
        self.ready = set(range(case.workers))
        self.next_step = [0] * case.workers
        self.version = [0] * case.workers  # the version of each worker's last reply
        self.bound = set()  # ranks whose legitimate traffic reached the core
        self.log = []
        self.values_at = {} if values_at is None else values_at  # version -> values (the undisturbed run's)
        self.record_values = values_at is None
        self.now = 0.0
        self.refusals = Counter()

    def run(self, hostile=()):
        events = 1 + self.case.workers * self.case.steps
        for i in range(events + 1):
            for _, kind, a, b in (h for h in hostile if min(h[0], events) == i):
                self.hostile(kind, a, b)
            if i == events:
                return self
            self.now += 0.25  # hostile messages take no time: held_s stays comparable
            if i == 0:
                self.deliver(self.core.handle(self.peers[0], Init(rank=0, data=self.x0.copy()), self.now))
                self.bound.add(0)
            else:
                ready = sorted(r for r in self.ready if self.next_step[r] < self.case.steps)
                r = ready[self.case.choices[i - 1] % len(ready)]
                step = self.next_step[r]
                msg = Push(rank=r, step=step, version=self.version[r], batch=self.case.batches[r], gen=0,
                           data=self.grads[r, step].copy())
                self.next_step[r] += 1
                self.ready.discard(r)
                self.bound.add(r)
                self.deliver(self.core.handle(self.peers[r], msg, self.now))
            if self.record_values:
                self.values_at[self.core.version] = self.core.values.copy()

    def deliver(self, out):
        round_trip(out)
        for o in out:
            if o.to == ATTACKER:  # a hostile pull, answered now: the shard as it was at that version
                np.testing.assert_array_equal(o.msg.data, self.values_at[o.msg.version])
                continue
            assert not isinstance(o.msg, Error), o.msg  # legitimate traffic is never refused
            if isinstance(o.msg, Params):
                r = self.peers.index(o.to)
                self.ready.add(r)
                self.version[r] = o.msg.version
                self.log.append((o.to, o.msg.request, o.msg.step, o.msg.version, o.msg.held_s, o.msg.plan, o.msg.data.tobytes()))
            else:
                self.log.append((o.to, o.msg))

    # -- hostile messages: each built to break exactly one rule, so the code is known --
    def hostile(self, kind, a, b):
        core, w, n = self.core, self.case.workers, self.case.n
        v = core.version
        r = a % w
        owner = self.peers[r]
        stranger = [ATTACKER, *(p for p in self.peers if p != owner)][b % w]
        pending = {q for q in range(w) if q not in self.ready} if self.mode == "bsp" else set()
        held = {q for q in self.bound if q not in self.ready} if self.mode == "ssp" else set()  # unanswered
        last = self.next_step[r] - 1  # asp/ssp: the newest step applied for rank r

        def push(rank, step=v, version=None, size=n, data=None):
            data = self.grads[rank % w, 0][:size] if data is None else data
            data = np.resize(data, size).astype(np.float32) if data.size != size else data
            return Push(rank=rank, step=step, version=min(v, b) if version is None else version, batch=1 + b % 9, gen=0,
                        data=data)

        if kind == "pull":
            return self.pull(Pull(request=a, at=None if b % 3 == 0 else v + b % 4))
        if kind == "other_op":
            return self.refused([owner, ATTACKER][b % 2], OTHER_OPS[a % len(OTHER_OPS)], "bad_op")
        if kind == "init":
            if core.initialized:
                return self.refused([owner, ATTACKER][b % 2], Init(rank=a % 3, data=self.x0.copy()),
                                    "already_initialized" if a % 3 == 0 else "bad_rank")
            if a % 3:  # before the init only worker 0 may send it, so a valid one would be taken
                return self.refused(stranger, Init(rank=a % 3, data=self.x0.copy()), "bad_rank")
            if n and b % 2:
                return self.refused(self.peers[0], Init(rank=0, data=self.nan(self.x0, b)), "non_finite")
            return self.refused(self.peers[0], Init(rank=0, data=np.zeros(n + 1 + b % 3, np.float32)), "bad_length")
        if not core.initialized:  # whatever the push, the shard serves nothing yet
            return self.refused([owner, ATTACKER][b % 2], push(a), "not_ready")
        if kind == "bad_rank":
            return self.refused([owner, ATTACKER][b % 2], push(w + a if b % 3 else 2**64 - 1), "bad_rank")
        if kind == "rank_taken" and r in self.bound:
            return self.refused(stranger, push(r), "rank_taken")
        if kind == "bad_length" and (n or b % 2):
            return self.refused(owner, push(r, size=n + 1 + b % 3 if b % 2 else a % n), "bad_length")
        if kind == "bad_version":
            return self.refused(owner, push(r, version=v + 1 + b), "bad_version")
        if kind == "bad_step" and self.mode == "bsp" and (v or b % 2):
            return self.refused(owner, push(r, step=v + 1 + b if b % 2 else b % v), "bad_step")
        if kind == "duplicate" and self.mode == "bsp" and r in pending:
            return self.refused(owner, push(r), "duplicate")
        if kind == "duplicate" and self.mode != "bsp" and last >= 0:
            return self.refused(owner, push(r, step=b % (last + 1)), "duplicate")
        if kind == "reply_held" and r in held:
            return self.refused(owner, push(r, step=last + 1 + b % 3), "reply_held")
        if kind == "non_finite" and n and r not in pending | held:
            step = v if self.mode == "bsp" else last + 1 + b % 3
            return self.refused(owner, push(r, step=step, data=self.nan(self.grads[r, 0], b)), "non_finite")
        if kind == "pull_passed" and v:
            return self.refused(ATTACKER, Pull(request=a, at=b % v), "version_passed")

    @staticmethod
    def nan(data, b):
        bad = data.copy()
        bad[b % bad.size] = [np.nan, np.inf, -np.inf, 3e38][b % 4]  # 3e38 is finite, its square is not
        return bad

    def refused(self, peer, msg, code):
        before = snapshot(self.core)
        with np.errstate(over="ignore"):  # 3e38 squared overflows on purpose
            out = self.core.handle(peer, msg, self.now)
        assert [(o.to, type(o.msg)) for o in out] == [(peer, Error)], out
        assert out[0].msg.code == code, (out[0].msg, msg)
        assert_same_state(before, snapshot(self.core))
        round_trip(out)
        self.refusals[code] += 1

    def pull(self, msg):
        self.deliver(self.core.handle(ATTACKER, msg, self.now))
        self.refusals["pull"] += 1


@pytest.mark.parametrize("mode", ["bsp", "asp", "ssp"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=shard_cases(), hostile=HOSTILE)
def test_hostile_messages_change_nothing_in_the_shard(mode, case, hostile):
    clean = ShardDrive(mode, case).run()
    fuzzed = ShardDrive(mode, case, values_at=clean.values_at).run(hostile)
    for code in fuzzed.refusals:
        event(code)
    assert fuzzed.log == clean.log  # the workers see exactly what they would have seen
    a, b = snapshot(clean.core), snapshot(fuzzed.core)
    del a["pulls"], b["pulls"]  # the hostile pulls still waiting for a version
    assert_same_state(a, b)


# -- ... and the registry ------------------------------------------------------------

CAPACITY = st.floats(min_value=0.0, exclude_min=True, allow_infinity=False) | st.integers(1, 2**64 - 1)


@dataclass(frozen=True)
class RegistryCase:
    job: JobSpec
    regs: tuple  # (peer, Register) in arrival order


@st.composite
def registry_cases(draw):
    servers, workers = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    job = JobSpec(num_servers=servers, num_workers=workers, global_batch=draw(st.integers(workers, 64)),
                  batching=draw(st.sampled_from(["uniform", "static", "dynamic"])))
    asked = draw(st.permutations(range(workers)))
    regs = [Register(role="server", host=draw(TEXT), endpoint=f"tcp://s{s}:1", pid=s) for s in range(servers)]
    regs += [Register(role="worker", host=draw(st.sampled_from(["a", "b"])), capacity=draw(CAPACITY),
                      device=draw(st.sampled_from(["cpu", "cuda:0"])), rank=asked[i] if draw(st.booleans()) else -1,
                      memory_limit=draw(U64)) for i in range(workers)]
    # what the wire delivers: each one passes decode
    regs = [codec.decode([bytes(f) for f in codec.encode(r)]) for r in regs]
    order = draw(st.permutations(range(len(regs))))
    return RegistryCase(job, tuple((b"p%d" % i, regs[i]) for i in order))


def registry_state(reg: Registry):
    return list(reg.servers), list(reg.waiting), dict(reg.workers), list(reg.joined), dict(reg.by_peer), reg.complete


def drive_registry(case: RegistryCase, hostile=()):
    reg = Registry(case.job, num_params=10, num_trained=8, total_steps=100, dead_after_s=30.0)
    log, refusals = [], Counter()
    for i in range(len(case.regs) + 1):
        for k, (_, kind, a, b) in enumerate(h for h in hostile if min(h[0], len(case.regs)) == i):
            resolved = _hostile_registration(reg, kind, a, b, b"h%d.%d" % (i, k))
            if resolved is None:
                continue
            peer, msg, code = resolved
            before = registry_state(reg)
            out = reg.register(peer, msg)
            assert [(to, type(m)) for to, m in out] == [(peer, Error)] and out[0][1].code == code, out
            assert registry_state(reg) == before
            refusals[code] += 1
        if i < len(case.regs):
            peer, msg = case.regs[i]
            log.append(reg.register(peer, msg))
    return reg, log, refusals


def _hostile_registration(reg: Registry, kind, a, b, new_peer):
    job = reg.job
    # before the start a worker's rank is the one it asked for (if any); after, the one it holds
    asked = list(reg.workers) if reg.complete else [m.info.rank for m in reg.waiting if m.info.rank >= 0]
    role = "worker" if kind in ("bad_rank", "rank_taken") or b % 2 else "server"
    if role == "server":
        full = len(reg.servers) >= job.num_servers
    else:
        full = not reg.vacant if reg.complete else len(reg.waiting) >= job.num_workers
    if kind == "duplicate" and reg.by_peer:
        peer, code = sorted(reg.by_peer)[a % len(reg.by_peer)], "duplicate"
        rank = -1
    elif kind == "full" and full:
        peer, code, rank = new_peer, "cluster_full", a % (job.num_workers + 1) - 1
    elif kind == "bad_rank" and not full:
        peer, code, rank = new_peer, "bad_rank", job.num_workers + a if b % 3 else 2**64 - 1
    elif kind == "rank_taken" and not full and asked:
        peer, code, rank = new_peer, "rank_taken", asked[a % len(asked)]
    else:
        return None
    msg = Register(role=role, host="h" * (a % 100), endpoint="tcp://evil:1", capacity=[5e-324, 1e308, 2**64 - 1][b % 3],
                   device="cuda:9", threads=2**64 - 1, pid=2**64 - 1, rank=rank, memory_limit=2**64 - 1)
    msg.check()
    return peer, msg, code


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=registry_cases(), hostile=st.lists(st.tuples(st.integers(0, 6),
                                                          st.sampled_from(["duplicate", "full", "bad_rank",
                                                                           "rank_taken"]),
                                                          st.integers(0, 2**16), st.integers(0, 2**16)),
                                                max_size=12))
def test_hostile_registrations_change_nothing(case, hostile):
    clean, clean_log, _ = drive_registry(case)
    fuzzed, log, refusals = drive_registry(case, hostile)
    for code in refusals:
        event(code)
    assert clean.complete
    assert sum(clean.static_batches(sorted(clean.workers))) == case.job.global_batch
    assert log == clean_log and registry_state(fuzzed) == registry_state(clean)


# -- 3. every socket of a running job -------------------------------------------------

E2E_JOB = ["--mode", "bsp", "--max-steps", "40", "--global-batch", "32", "--lr", "0.05", "--seed", "23",
           "--heartbeat", "0.2"]  # metrics.jsonl is flushed with each heartbeat: the attack starts sooner
E2E_WORKERS = [WorkerSpec(ms_per_step=40.0), WorkerSpec(ms_per_step=40.0)]
E2E_SERVERS = 2
ATTACKERS = 3  # DEALERs per listening socket
ROUNDS, ROUND_S = 120, 0.03  # at most 120 messages per attacker and socket, one per 30 ms


def _cluster_facts(run_dir) -> tuple[int, list[str]]:
    """The parameter count and the servers' endpoints, once training has begun:
    by then every worker has bound its rank at every server."""
    wait_for_event(run_dir, lambda e: e["event"] == "step", 60)
    events = read_events(run_dir)
    start = next(e for e in events if e["event"] == "start")
    servers = sorted((e["rank"], e["endpoint"]) for e in events if e["event"] == "membership" and e["role"] == "server")
    return start["num_params"], [ep for _, ep in servers]


def _bases(rng, data: np.ndarray) -> list[protocol.Message]:
    """Real messages of every op with plausible values for this job; the pushes and
    inits are ones the real workers could have sent (their ranks, the shard's length)."""
    w = len(E2E_WORKERS)
    step = rng.randrange(40)
    push = Push(rank=rng.randrange(w), step=step, version=step, batch=16, gen=0, data=data)
    return [
        push, push, push,
        Push(rank=w, step=step, version=step, batch=16, gen=0, data=data),
        Init(rank=0, data=data),
        Pull(request=rng.randrange(100), at=rng.choice([None, 0, rng.randrange(45)])),
        Register(role="worker", host="evil", capacity=1.0, rank=rng.randrange(-1, w)),
        Register(role="server", host="evil", endpoint="tcp://127.0.0.1:1"),
        Report(rank=rng.randrange(w), step=step, batch=16, compute_s=0.01, network_s=0.0, wait_s=0.0, loss=1.0,
               done=rng.random() < 0.5),
        Heartbeat(), Ack(), Shutdown(ok=rng.random() < 0.5, reason="evil"), Error(code="x", text="y"),
        Heartbeat(phase="evil", step=step, waited_s=9.0, servers=[0]), Failed(reason="evil"),
        Plan(plan=BatchPlan(rng.randrange(1, 9), (1, 31), stop=rng.random() < 0.5)),
        SAMPLE["welcome"],
        Params(step=step, version=step + 1, held_s=0.0, plan=BatchPlan(5, (1, 31), stop=True), data=data),
    ]


def _attack(cluster, run_dir) -> tuple[Counter, Counter]:
    """Mutated and unmutated real messages from several DEALERs at the scheduler's and
    every server's ROUTER, paced over the run; returns messages sent and error replies
    received, by target."""
    num_params, servers = _cluster_facts(run_dir)
    rng = random.Random(17)
    targets = {"scheduler": (cluster.endpoint, np.zeros(0, np.float32))}  # it takes headers only
    for s, (ep, (lo, hi)) in enumerate(zip(servers, shard_ranges(num_params, len(servers)))):
        targets[f"server{s}"] = (ep, np.asarray(rng.choices([0.0, 1e-3, -0.5], k=hi - lo), dtype=np.float32))
    ctx = zmq.Context()
    socks, poller = [], zmq.Poller()
    for name, (ep, _) in targets.items():
        for _ in range(ATTACKERS):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 50)
            sock.connect(ep)
            socks.append((name, sock))
            poller.register(sock, zmq.POLLIN)
    sent, errors = Counter(), Counter()
    w = len(E2E_WORKERS)
    try:
        for name, sock in socks:  # first, every real worker's push from a stranger
            if name != "scheduler":
                for rank in range(w):
                    data = targets[name][1]
                    sock.send_multipart(codec.encode(Push(rank=rank, step=1, version=1, batch=16, gen=0, data=data)),
                                        flags=zmq.NOBLOCK)  # its queue is empty: this cannot fail
                    sent[name] += 1
        for _ in range(ROUNDS):
            if cluster.poll() is not None:
                break
            round_end = time.monotonic() + ROUND_S
            for name, sock in socks:
                msg = rng.choice(_bases(rng, targets[name][1]))
                frames = codec.encode(msg) if rng.random() < 0.3 else mutated(msg, rng, rng.randint(1, 3))[0]
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                    sent[name] += 1
                except zmq.Again:
                    pass
            while (left := round_end - time.monotonic()) > 0:  # read the replies while this round lasts
                for sock, _ in poller.poll(left * 1000):
                    reply = codec.decode(sock.recv_multipart())
                    if isinstance(reply, Error):
                        errors[next(name for name, s in socks if s is sock)] += 1
    finally:
        ctx.destroy(linger=0)
    return sent, errors


@pytest.mark.cluster
def test_fuzzing_every_socket_changes_nothing(tmp_path):
    # the undisturbed run goes alongside: the result does not depend on timing
    with start_cluster(tmp_path / "quiet", E2E_JOB, E2E_WORKERS, E2E_SERVERS) as quiet, \
            start_cluster(tmp_path / "attacked", E2E_JOB, E2E_WORKERS, E2E_SERVERS) as cluster:
        sent, errors = _attack(cluster, tmp_path / "attacked")
        attacked, quiet = finish(cluster), finish(quiet)  # every process exits 0
    assert attacked.summary["status"] == "completed"
    for name in ["scheduler", *(f"server{s}" for s in range(E2E_SERVERS))]:
        assert sent[name] >= 50 and errors[name] > 0, (sent, errors)
        log = (attacked.dir / "logs" / f"{name}.log").read_text()
        assert log.count("refused") > 0, name
        if name != "scheduler":  # real workers' ranks, offered by a stranger
            assert "rank_taken" in log, name
    want, got = torch.load(quiet.dir / "model.pt"), torch.load(attacked.dir / "model.pt")
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k  # BSP is bit-for-bit repeatable
    assert attacked.summary["steps"] == quiet.summary["steps"] == 40
