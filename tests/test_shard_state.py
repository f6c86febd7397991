"""A shard core's state and its restore, checkpoint requests at the core, and the
server's background writer, without processes."""

import gc
import tempfile
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips import checkpoint
from omnips.checkpoint import CheckpointError, FileInfo
from omnips.job import JobSpec
from omnips.protocol import Checkpoint, Init, Params, Pull, Saved
from omnips.server import checkpointer
from omnips.server.shard import ShardCore
from omnips.server.shard_state import ShardState, Snapshot

from helpers import written
from shard_helpers import PEERS, SCHED, assert_same_state, push, snapshot

# -- a shard's state and its restore ----------------------------------------------------------

OPTIMIZERS = [dict(momentum=0.9), dict(momentum=0.0), dict(momentum=0.9, nesterov=True), dict(optimizer="adam")]


def core_for(mode, opt, n=6, num_trained=4, init=True):
    job = JobSpec(mode=mode, num_workers=3, global_batch=32, lr=0.1, weight_decay=0.01, **opt)
    job.check()
    core = ShardCore(job, 0, n, num_trained)
    if init:
        core.handle(PEERS[0], Init(rank=0, data=np.linspace(-1, 1, n, dtype=np.float32)), 0.0)
    return core


def run_steps(core, rng, steps, first=0):
    """`steps` rounds of pushes from all three workers, their batches changing every round
    (dana's buffers are rescaled to a new eta); returns every reply."""
    out = []
    for step in range(first, first + steps):
        for r in (2, 0, 1):
            ver = core.version if core.job.mode == "bsp" else max(0, core.version - r)
            out += core.handle(PEERS[r], push(r, step, rng.standard_normal(core.n).astype(np.float32),
                                              batch=4 + r + step % 2, version=ver), 1.0)
    return out


def through_file(state: ShardState) -> ShardState:
    """What a restore gets: the state written and read back."""
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = written(tmp, state.meta, state.arrays)
        meta, arrs = checkpoint.read_shard(path)
        return ShardState(meta, {k: v.copy() for k, v in arrs.items()})


@settings(max_examples=24, deadline=None)
@given(mode=st.sampled_from(["bsp", "asp", "ssp"]), opt=st.sampled_from(OPTIMIZERS), before=st.integers(0, 4),
       seed=st.integers(0, 2**31))
def test_a_restored_core_continues_bit_for_bit_like_the_original(mode, opt, before, seed):
    rng = np.random.default_rng(seed)
    original = core_for(mode, opt)
    run_steps(original, rng, before)
    restored = core_for(mode, opt, init=False)
    restored.restore(through_file(original.state()))
    assert restored.initialized and restored.version == original.version
    state = original.state()
    grads = rng.bit_generator.state
    a = run_steps(original, rng, 3, first=before)
    rng.bit_generator.state = grads
    b = run_steps(restored, rng, 3, first=before)
    assert [(o.to, o.msg.version) for o in a] == [(o.to, o.msg.version) for o in b] and a
    for x, y in zip(a, b):
        assert x.msg.data.tobytes() == y.msg.data.tobytes()
    assert original.values.tobytes() == restored.values.tobytes()
    after_a, after_b = original.state(), restored.state()
    assert after_a.meta == after_b.meta
    assert {k: v.tobytes() for k, v in after_a.arrays.items()} == {k: v.tobytes() for k, v in after_b.arrays.items()}
    assert state.meta["version"] < after_a.meta["version"]


def _state_with(core, **changes) -> ShardState:
    s = core.state()
    meta, arrs = dict(s.meta), dict(s.arrays)
    for key, value in changes.items():
        (arrs if key in arrs or key.startswith("opt.") else meta)[key] = value
    return ShardState(meta, {k: v for k, v in arrs.items() if v is not None})


@pytest.mark.parametrize("change, text", [
    (lambda c: _state_with(core_for("bsp", dict(momentum=0.5))), "another job"),
    (lambda c: _state_with(core_for("asp", dict(momentum=0.9))), "another job"),
    (lambda c: _state_with(core_for("bsp", dict(optimizer="adam"))), "another job"),
    (lambda c: _state_with(core_for("bsp", dict(momentum=0.9), n=7)), "holds 7 values"),
    (lambda c: _state_with(c, values=np.zeros(6, np.float64)), "float32"),
    (lambda c: _state_with(c, values=np.zeros(5, np.float32)), "float32"),
    (lambda c: _state_with(c, **{"opt.momentum_buffer": None}), "optimizer state"),
    (lambda c: _state_with(c, **{"opt.momentum_buffer": np.zeros(3, np.float32)}), "optimizer buffer"),
    (lambda c: _state_with(c, **{"opt.extra": np.zeros(4, np.float32)}), "optimizer state"),
    (lambda c: _state_with(c, optimizer={"first": 1}), "not a bool"),
    (lambda c: _state_with(c, version=-1), "malformed"),
    (lambda c: _state_with(c, last_step=[0, 0]), "malformed"),
    (lambda c: _state_with(c, staleness=[0]), "malformed"),
    (lambda c: _state_with(c, values=None), "float32"),
])
def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(change, text):
    core = core_for("bsp", dict(momentum=0.9))
    run_steps(core, np.random.default_rng(0), 2)
    bad = change(core)
    before = snapshot(core)
    with pytest.raises(ValueError, match=text):
        core.restore(bad)
    assert_same_state(before, snapshot(core))


def test_restore_is_refused_while_pushes_wait_at_the_barrier():
    core = core_for("bsp", dict(momentum=0.9))
    state = core.state()
    core.handle(PEERS[1], push(1, 0, np.ones(6)), 0.0)
    with pytest.raises(ValueError, match="in flight"):
        core.restore(state)


def test_asp_restore_takes_the_workers_resume_steps():
    """An ASP snapshot may hold worker 1's step 4 although the scheduler resumes it at step 3."""
    core = core_for("asp", dict(momentum=0.9))
    run_steps(core, np.random.default_rng(1), 5)
    fresh = core_for("asp", dict(momentum=0.9), init=False)
    fresh.restore(core.state(), next_steps=[5, 3, 0])
    assert fresh.holds.last_step == {0: 4, 1: 2}
    out = fresh.handle(PEERS[1], push(1, 3, np.ones(6), version=fresh.version), 0.0)
    assert isinstance(out[0].msg, Params)
    with pytest.raises(ValueError, match="one step count per worker"):
        fresh.restore(core.state(), next_steps=[1, 2])


# -- checkpoint requests at the core ---------------------------------------------------------

def test_bsp_checkpoint_is_taken_exactly_at_its_version():
    core = core_for("bsp", dict(momentum=0.9))
    rng = np.random.default_rng(2)
    assert core.handle(SCHED, Checkpoint(request=1, step=2, at=2), 0.0) == []
    out = run_steps(core, rng, 1)
    assert not any(isinstance(o, Snapshot) for o in out)
    out = run_steps(core, rng, 1, first=1)
    snaps = [o for o in out if isinstance(o, Snapshot)]
    assert len(snaps) == 1 and (snaps[0].to, snaps[0].request, snaps[0].step) == (SCHED, 1, 2)
    expected_values = core.values.copy()
    assert snaps[0].state.meta["version"] == 2
    run_steps(core, rng, 1, first=2)  # the snapshot is a copy: later updates do not reach it
    assert snaps[0].state.arrays["values"].tobytes() == expected_values.tobytes()
    late = core.handle(SCHED, Checkpoint(request=2, step=2, at=2), 0.0)
    assert len(late) == 1 and isinstance(late[0].msg, Saved) and late[0].msg.error.startswith("version_passed")
    now = core.handle(SCHED, Checkpoint(request=3, step=7, at=None), 0.0)
    assert isinstance(now[0], Snapshot) and now[0].state.meta["version"] == 3


def test_a_checkpoint_asked_before_init_waits_for_it():
    core = core_for("asp", dict(momentum=0.9), init=False)
    assert core.handle(SCHED, Checkpoint(request=1, step=0), 0.0) == []
    out = core.handle(PEERS[0], Init(rank=0, data=np.ones(6, np.float32)), 0.0)
    assert isinstance(out[1], Snapshot) and out[1].state.arrays["values"].tolist() == [1.0] * 6
    assert core.handle(SCHED, Pull(request=2, at=0), 0.0)[0].msg.version == 0  # pulls still served as before


# -- the server's writer and restore ----------------------------------------------------------

def _snap(core, step, request=1) -> Snapshot:
    return Snapshot(SCHED, request, step, core.state())


def test_writer_writes_in_the_background_and_the_server_restores_from_it(tmp_path):
    core = core_for("bsp", dict(momentum=0.9))
    run_steps(core, np.random.default_rng(3), 2)
    writer = checkpointer.ShardWriter(tmp_path, rank=0, lo=0, hi=6)
    assert writer.submit(_snap(core, 2)) == []
    (answer,) = writer.finished(wait_s=30)
    saved = answer.msg
    assert answer.to == SCHED and (saved.request, saved.step, saved.version, saved.error) == (1, 2, 2, "")
    shard = checkpoint.step_dir(tmp_path, 2) / checkpoint.shard_name(0)
    assert checkpoint.file_info(shard) == FileInfo(saved.size, saved.sha256)
    checkpoint.write_manifest(shard.parent, 2, core.job.to_dict(),
                              [{"range": [0, 6], "version": 2, "size": saved.size, "sha256": saved.sha256}],
                              [2, 2, 2], [64, 64, 64])
    fresh = core_for("bsp", dict(momentum=0.9), init=False)
    assert checkpointer.load(fresh, str(shard.parent), 0, 0, 6) == 2
    assert fresh.values.tobytes() == core.values.tobytes()
    with pytest.raises(CheckpointError, match="no shard"):
        checkpointer.load(core_for("bsp", dict(momentum=0.9), init=False), str(shard.parent), 0, 0, 5)


def test_a_failed_write_is_answered_said_in_one_line_and_the_server_goes_on(tmp_path, caplog):
    (tmp_path / "step-2").write_text("a file where the directory should be")
    writer = checkpointer.ShardWriter(tmp_path, rank=0, lo=0, hi=6)
    writer.submit(_snap(core_for("bsp", dict(momentum=0.9)), 2))
    (answer,) = writer.finished(wait_s=30)
    assert answer.msg.error.startswith("writing") and answer.msg.size == 0
    (said,) = caplog.records  # a full disk fails every checkpoint: a line each, no traceback
    assert said.exc_info is None and said.getMessage().startswith("server 0 on ")
    assert "checkpoint 2 not written: writing" in said.getMessage()


def test_a_snapshot_waits_for_the_previous_write_at_most_wait_s(tmp_path, monkeypatch):
    release, real = threading.Event(), checkpoint.write_shard

    def slow_write(*args):
        assert release.wait(30)
        return real(*args)
    monkeypatch.setattr(checkpoint, "write_shard", slow_write)
    core = core_for("bsp", dict(momentum=0.9))
    writer = checkpointer.ShardWriter(tmp_path, rank=0, lo=0, hi=6, wait_s=0.05)
    assert writer.submit(_snap(core, 1, request=1)) == []
    (refused,) = writer.submit(_snap(core, 2, request=2))
    assert (refused.msg.request, refused.msg.size) == (2, 0) and "still being written" in refused.msg.error
    assert writer.finished() == []
    release.set()
    (first,) = writer.finished(wait_s=30)
    assert (first.msg.request, first.msg.error) == (1, "") and first.msg.size > 0


def test_a_state_saved_before_a_job_setting_existed_restores_at_its_default():
    core = core_for("bsp", dict(momentum=0.9))
    run_steps(core, np.random.default_rng(0), 2)
    old = core.state()
    job = {k: v for k, v in old.meta["job"].items() if k != "wire_dtype"}  # a file written before --wire-dtype
    restored = core_for("bsp", dict(momentum=0.9), init=False)
    restored.restore(ShardState({**old.meta, "job": job}, old.arrays))
    assert restored.version == core.version and restored.values.tobytes() == core.values.tobytes()
    with pytest.raises(ValueError, match="another job"):  # a setting this version does not know: not this job
        core_for("bsp", dict(momentum=0.9), init=False).restore(ShardState({**old.meta, "job": {**job, "x": 1}},
                                                                             old.arrays))


# -- the copy snapshot replies share ------------------------------------------------------------

def test_snapshot_replies_share_one_read_only_copy_per_change_of_the_values():
    core = core_for("bsp", OPTIMIZERS[0], init=False)
    zeros = core.frozen()
    core.handle(PEERS[0], Init(rank=0, data=np.linspace(-1, 1, core.n, dtype=np.float32)), 0.0)
    first = core.frozen()
    assert first is not zeros and first.any() and not zeros.any()  # init is a change
    assert first is core.frozen()  # no change: the same copy
    assert not first.flags.writeable and np.array_equal(first, core.values)
    assert not np.shares_memory(first, core.values)
    state = core.state()
    rng = np.random.default_rng(0)
    for r in range(3):  # a step, taken lazily: the copy holds it written whole
        core.handle(PEERS[r], push(r, 0, rng.standard_normal(core.n).astype(np.float32)), 1.0, lazy=True)
    stepped = core.frozen()
    assert stepped is not first and np.array_equal(stepped, core.values) and not np.array_equal(stepped, first)
    core.restore(state)
    assert np.array_equal(core.frozen(), first) and core.frozen() is not stepped  # a restore is a change
    gone = weakref.ref(core.frozen())
    gc.collect()
    assert gone() is None  # the core does not keep it: only the replies that carry it do
    assert np.array_equal(core.frozen(), core.values)
