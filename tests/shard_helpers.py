"""Driving a server.shard.ShardCore directly in tests: peers, a core, pushes and parts, state snapshots, refusals."""

import numpy as np

from omnips import codec
from omnips.job import JobSpec
from omnips.protocol import Ack, Error, Init, Push
from omnips.server.shard import Outgoing, ShardCore

PEERS = [b"w0", b"w1", b"w2"]
SCHED = b"scheduler"


def make_core(mode="bsp", n=6, num_trained=None, lo=0, num_workers=3, global_batch=32, lr=0.1,
              momentum=0.9, weight_decay=0.01, nesterov=False, init=None, now=0.0, staleness=3, wire_dtype="float32",
              optimizer="sgd", max_steps=None, async_correction=JobSpec.async_correction):
    job = JobSpec(mode=mode, num_workers=num_workers, global_batch=global_batch, lr=lr, momentum=momentum,
                  weight_decay=weight_decay, nesterov=nesterov, staleness=staleness, wire_dtype=wire_dtype,
                  optimizer=optimizer, max_steps=max_steps, async_correction=async_correction)
    job.check()
    core = ShardCore(job, lo, lo + n, lo + n if num_trained is None else num_trained)
    if init is not None:
        out = core.handle(PEERS[0], Init(rank=0, data=np.asarray(init, dtype=np.float32)), now)
        assert out == [Outgoing(PEERS[0], Ack())]
    return core


def push(rank, step, data, batch=4, version=None, gen=0):
    return Push(rank=rank, step=step, version=step if version is None else version, batch=batch, gen=gen,
                data=np.asarray(data, dtype=np.float32))


def snapshot(core: ShardCore) -> dict:
    """Everything a refused message must leave alone."""
    buf = getattr(core.store.opt, "buf", None)
    return {
        "values": core.values.copy(),
        "version": core.version,
        "initialized": core.initialized,
        "pending": {r: (peer, p.step, p.batch, [(lo, v.copy()) for lo, v in segs], t)
                    for r, (peer, p, t, segs) in core.barrier.pending.items()},
        "owner": dict(core.members.owner),
        "last_step": dict(core.holds.last_step),
        "pulls": list(core._pulls.entries),
        "held": [(peer, p.rank, p.step, t) for peer, p, t in core.holds.held],
        "plan": core.plan,
        "momentum": None if buf is None else buf.clone().numpy(),
        "updates": core.updates,
        "staleness": (core.staleness_sum, core.staleness_max),
        "asynchrony": core.store.correction.state(),
    }


def assert_same_state(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if k == "pending":
            assert a[k].keys() == b[k].keys()
            for r in a[k]:
                pa, pb = a[k][r], b[k][r]
                assert pa[:3] == pb[:3] and pa[4] == pb[4]
                assert [lo for lo, _ in pa[3]] == [lo for lo, _ in pb[3]]
                for (_, va), (_, vb) in zip(pa[3], pb[3]):
                    np.testing.assert_array_equal(va, vb)
        elif isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k])
        else:
            assert a[k] == b[k], k


def assert_refused(core, peer, msg, code, now=100.0):
    before = snapshot(core)
    out = core.handle(peer, msg, now)
    assert len(out) == 1 and out[0].to == peer and isinstance(out[0].msg, Error), out
    assert out[0].msg.code == code, out[0].msg
    assert_same_state(before, snapshot(core))
    round_trip(out)


def round_trip(outs):
    """Every reply is a valid wire message."""
    for o in outs:
        frames = [bytes(f) for f in codec.encode(o.msg)]
        assert type(codec.decode(frames)) is type(o.msg)


def parts_of(values: np.ndarray, cuts: list[int], **fields) -> list[Push]:
    edges = [0, *cuts, values.size]
    return [Push(rank=fields.get("rank", 0), step=fields.get("step", 0), version=0, batch=fields.get("batch", 4), gen=0,
                 data=values[lo:hi], offset=lo, whole=values.size) for lo, hi in zip(edges, edges[1:]) if hi > lo]
