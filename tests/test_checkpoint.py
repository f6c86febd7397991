"""Checkpoint files without processes: shard files (round trip, torn and damaged files
detected, atomic replacement), manifests, which checkpoint is complete, pruning."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnips import checkpoint
from omnips.checkpoint import CheckpointError, FileInfo

from helpers import CHECKPOINT_JOB, make_checkpoint, written

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# -- shard files ----------------------------------------------------------------------------

JSONABLE = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.floats(allow_nan=False,
                        allow_infinity=False) | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3), max_leaves=8)
DTYPES = st.sampled_from(["<f4", "<f8", "<i8", "|u1"])


@st.composite
def arrays(draw):
    names = draw(st.lists(st.text(min_size=1, max_size=6), unique=True, max_size=4))
    out = {}
    for name in names:
        dt = np.dtype(draw(DTYPES))
        raw = draw(st.binary(min_size=0, max_size=8 * 9).map(lambda b, n=dt.itemsize: b[:len(b) // n * n]))
        out[name] = np.frombuffer(raw, dtype=dt).copy()
    return out


@FAST
@given(meta=st.dictionaries(st.text(max_size=5), JSONABLE, max_size=4), arrs=arrays())
def test_shard_file_round_trip(meta, arrs):
    with tempfile.TemporaryDirectory() as tmp:
        path, info = written(tmp, meta, arrs)
        got_meta, got = checkpoint.read_shard(path, info)
        assert got_meta == meta
        assert list(got) == list(arrs)  # names in order
        for name, a in arrs.items():
            assert got[name].dtype == a.dtype and got[name].tobytes() == a.tobytes()  # bit for bit
        assert checkpoint.file_info(path, info) == info == FileInfo(path.stat().st_size, info.sha256)
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


@FAST
@given(cut=st.integers(0, 200))
def test_a_torn_file_is_detected(cut):
    with tempfile.TemporaryDirectory() as tmp:
        path, info = written(tmp)
        data = path.read_bytes()
        path.write_bytes(data[:min(cut, len(data) - 1)])
        for load in (lambda: checkpoint.read_shard(path), lambda: checkpoint.file_info(path)):
            with pytest.raises(CheckpointError, match="torn or damaged"):
                load()


@FAST
@given(where=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_any_damaged_byte_is_detected(where, flip):
    with tempfile.TemporaryDirectory() as tmp:
        path, info = written(tmp)
        data = bytearray(path.read_bytes())
        data[where % len(data)] ^= flip
        path.write_bytes(bytes(data))
        for load in (lambda: checkpoint.read_shard(path, info), lambda: checkpoint.file_info(path, info)):
            with pytest.raises(CheckpointError):
                load()


def test_a_whole_file_that_is_not_the_manifests_is_refused(tmp_path):
    path, info = written(tmp_path)
    other = checkpoint.write_shard(path, {"rank": 0}, {"values": np.ones(10, np.float32)})
    assert other.size == info.size
    with pytest.raises(CheckpointError, match="not the one its manifest lists"):
        checkpoint.read_shard(path, info)
    with pytest.raises(CheckpointError, match="its manifest says"):
        checkpoint.file_info(path, FileInfo(info.size + 1, info.sha256))
    with pytest.raises(CheckpointError, match="cannot read"):
        checkpoint.read_shard(tmp_path / "missing.ckpt")


def test_a_failed_write_leaves_the_previous_file_whole_and_no_temporary_file(tmp_path, monkeypatch):
    path, info = written(tmp_path)

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(checkpoint.os, "replace", no_rename)
    with pytest.raises(OSError):
        checkpoint.write_shard(path, {"rank": 0}, {"values": np.ones(10, np.float32)})
    assert checkpoint.read_shard(path, info)[1]["values"].tolist() == list(range(10))
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # a full disk is left no fuller


# -- manifests: complete, newest, pruned ------------------------------------------------------

def test_newest_complete_passes_over_incomplete_and_damaged_checkpoints(tmp_path):
    assert checkpoint.newest_complete(tmp_path / "none") == (None, [])
    for step in (5, 10, 15):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 20, complete=False)
    ckpt, skipped = checkpoint.newest_complete(tmp_path)
    assert ckpt.step == 15 and skipped == [f"{tmp_path / 'step-20'}: incomplete (no manifest)"]
    assert (ckpt.worker_steps, ckpt.positions, ckpt.job) == ([15, 15], [960, 960], CHECKPOINT_JOB.to_dict())
    # damage a shard of 15, remove one of 10: 5 is the newest whole one
    shard = ckpt.shard_file(1)
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    (checkpoint.step_dir(tmp_path, 10) / checkpoint.shard_name(0)).unlink()
    ckpt, skipped = checkpoint.newest_complete(tmp_path)
    assert ckpt.step == 5 and len(skipped) == 3
    assert "torn or damaged" in skipped[1] and "cannot read" in skipped[2]
    (checkpoint.step_dir(tmp_path, 5) / checkpoint.MANIFEST).write_text("{not json")
    assert checkpoint.newest_complete(tmp_path)[0] is None


@pytest.mark.parametrize("damage", [
    lambda m: m.pop("shards"), lambda m: m.update(step=-1), lambda m: m.update(worker_steps=[1]),
    lambda m: m["shards"][0].update(size="12"), lambda m: m.update(format=99), lambda m: m.update(positions=None),
])
def test_a_malformed_manifest_is_refused(tmp_path, damage):
    directory = make_checkpoint(tmp_path, 5)
    manifest = json.loads((directory / checkpoint.MANIFEST).read_text())
    damage(manifest)
    (directory / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="malformed"):
        checkpoint.read_manifest(directory)
    assert checkpoint.newest_complete(tmp_path)[0] is None


@pytest.mark.parametrize("text", ["[" * 200_000, "{" * 5])
def test_a_manifest_that_is_not_json_is_refused(tmp_path, text):
    directory = make_checkpoint(tmp_path, 5)
    (directory / checkpoint.MANIFEST).write_text(text)  # nested deeper than the parser recurses, or cut short
    with pytest.raises(CheckpointError, match="is not JSON"):
        checkpoint.read_manifest(directory)


@settings(max_examples=40, deadline=None)
@given(dirs=st.dictionaries(st.integers(0, 60), st.booleans(), max_size=8), after=st.integers(-1, 60))
def test_prune_keeps_the_two_newest_complete_everything_newer_and_an_earlier_runs(dirs, after):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for step, complete in dirs.items():
            checkpoint.step_dir(root, step).mkdir()
            if complete:
                (checkpoint.step_dir(root, step) / checkpoint.MANIFEST).write_text("{}")
        removed = checkpoint.prune(root, after=after)
        left = sorted(int(p.name.split("-")[1]) for p in root.iterdir())
        complete = sorted(s for s, c in dirs.items() if c)
        if len(complete) < checkpoint.KEEP:
            assert removed == [] and left == sorted(dirs)
        else:
            assert left == [s for s in sorted(dirs) if s <= after or s >= complete[-checkpoint.KEEP]]
        assert sorted(int(p.name.split("-")[1]) for p in removed) == sorted(set(dirs) - set(left))


def test_set_aside_after_renames_newer_checkpoints_and_deletes_nothing(tmp_path):
    for step in (5, 10, 15, 20):
        make_checkpoint(tmp_path, step, complete=step != 20)
    (tmp_path / "step-x").mkdir()  # not a checkpoint: left alone
    (tmp_path / "step-15.set-aside-unverified").mkdir()  # set aside by an earlier resume
    moved = checkpoint.set_aside_after(tmp_path, 10)
    assert [(old.name, new.name) for old, new in moved] == [("step-15", "step-15.set-aside-unverified-2"),
                                                             ("step-20", "step-20.set-aside-incomplete")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-10", "step-15.set-aside-unverified",
                                                          "step-15.set-aside-unverified-2",
                                                          "step-20.set-aside-incomplete", "step-5", "step-x"]
    assert checkpoint.read_manifest(tmp_path / "step-15.set-aside-unverified-2").step == 15  # whole
    assert checkpoint.newest_complete(tmp_path)[0].step == 10  # out of a later resume's way
