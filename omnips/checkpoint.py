"""Checkpoint files: one file per server shard, a manifest per checkpoint, and the rule
for which checkpoint is complete. File logic only, no sockets and no threads.

Layout: CHECKPOINTS/step-<N>/shard-<s>.ckpt, written by server s, and
manifest.json, written by the scheduler once every server has reported its
file. A checkpoint is complete when its manifest exists and every shard file
it lists has the size and SHA-256 recorded there.

A shard file is MAGIC, the header's length (8 bytes, little-endian), a JSON
header (the writer's metadata, and each array's name, dtype and length), the
arrays' raw bytes, and the SHA-256 of everything before it. It is written to a
temporary file in the same directory, flushed, fsynced, renamed over its name,
and the directory is fsynced: a reader finds no file or a whole one, and a file
torn or damaged afterwards fails its digest.
"""

import hashlib
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .metrics import atomic_file, fsync_dir, write_json_atomic

FORMAT = 1
MAGIC = b"OMNIPS-SHARD\n"
MANIFEST = "manifest.json"
KEEP = 2  # complete checkpoints kept: the newest, and one to fall back on if it is damaged
_DIGEST = 32
_LEN = struct.Struct("<Q")
_STEP_DIR = re.compile(r"step-(\d+)")
_CHUNK = 1 << 22


class CheckpointError(ValueError):
    """A checkpoint file or manifest that cannot be used; the text says which and why."""


@dataclass(frozen=True)
class FileInfo:
    size: int
    sha256: str  # of the file's bytes before its trailing digest


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def shard_name(rank: int) -> str:
    return f"shard-{rank}.ckpt"


# -- shard files ------------------------------------------------------------------------

def write_shard(path: Path, meta: dict, arrays: dict[str, np.ndarray]) -> FileInfo:
    """Write `meta` (JSON-able) and 1-D `arrays` durably and atomically to `path`."""
    if any(a.ndim != 1 for a in arrays.values()):
        raise ValueError("checkpoint arrays must be 1-D")
    header = json.dumps({"format": FORMAT, "meta": meta, "arrays": [[name, a.dtype.str, int(a.size)]
                                                                     for name, a in arrays.items()]},
                        allow_nan=False).encode()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fsync_dir(path.parent.parent)  # the step directory's own entry
    digest, size = hashlib.sha256(), 0
    with atomic_file(path, "wb") as f:
        parts = [MAGIC, _LEN.pack(len(header)), header,
                 *(np.ascontiguousarray(a).view(np.uint8) for a in arrays.values())]
        for part in parts:
            digest.update(part)
            f.write(part)
            size += len(part) if isinstance(part, bytes) else part.nbytes
        f.write(digest.digest())
    return FileInfo(size + _DIGEST, digest.hexdigest())


def read_shard(path: Path, expect: FileInfo | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a shard file, after checking its digest (and `expect`, the
    manifest's record of it). The arrays are views of one buffer holding the file."""
    try:
        with open(path, "rb") as f:
            raw = bytearray(os.fstat(f.fileno()).st_size)
            if f.readinto(raw) != len(raw):
                raise OSError(0, "the file shrank while it was read")
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc.strerror}") from None
    body = memoryview(raw)[:-_DIGEST]
    _check_digest(path, len(raw), hashlib.sha256(body).digest(), raw[-_DIGEST:], expect)
    try:
        start = len(MAGIC) + _LEN.size
        (n,) = _LEN.unpack_from(raw, len(MAGIC))
        header = json.loads(bytes(body[start:start + n]))
        if header["format"] != FORMAT:
            raise CheckpointError(f"checkpoint file {path} has format {header['format']!r}, this code reads {FORMAT}")
        arrays, offset = {}, start + n
        for name, dtype, length in header["arrays"]:
            dt = np.dtype(dtype)
            if dt.kind not in "fiub" or not isinstance(length, int) or length < 0:
                raise ValueError(f"array {name!r}: {dtype} x {length}")
            arrays[name] = np.frombuffer(raw, dtype=dt, count=length, offset=offset)
            offset += dt.itemsize * length
        if offset != len(body):
            raise ValueError(f"arrays end at byte {offset}, the data at {len(body)}")
        return header["meta"], arrays
    except CheckpointError:
        raise
    except (ValueError, TypeError, KeyError, struct.error, RecursionError) as exc:
        raise CheckpointError(f"checkpoint file {path} has a malformed header: {exc}") from None


def file_info(path: Path, expect: FileInfo | None = None) -> FileInfo:
    """Size and digest of a shard file, read in chunks; CheckpointError if it is torn or
    damaged, or is not the file `expect` describes."""
    digest, tail = hashlib.sha256(), b""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            left = size - _DIGEST
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
            tail = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc.strerror}") from None
    _check_digest(path, size, digest.digest(), tail, expect)
    return FileInfo(size, digest.hexdigest())


def _check_digest(path, size: int, digest: bytes, tail: bytes, expect: FileInfo | None) -> None:
    if expect is not None and size != expect.size:
        raise CheckpointError(f"checkpoint file {path} has {size} bytes, its manifest says {expect.size}")
    if size < len(MAGIC) + _LEN.size + _DIGEST or digest != tail:
        raise CheckpointError(f"checkpoint file {path} is torn or damaged (its SHA-256 does not match)")
    if expect is not None and digest.hex() != expect.sha256:
        raise CheckpointError(f"checkpoint file {path} is not the one its manifest lists (SHA-256 differs)")


# -- manifests and whole checkpoints ------------------------------------------------------

@dataclass(frozen=True)
class Manifest:
    """A checkpoint's directory and manifest: the job, each shard's file, and where every
    worker resumes (`worker_steps`: the next step; `positions`: its sample-stream position)."""

    path: Path
    step: int
    job: dict
    shards: list[dict]  # by server rank: {"range": [lo, hi], "version", "size", "sha256"}
    worker_steps: list[int]
    positions: list[int]

    def shard_file(self, rank: int) -> Path:
        return self.path / shard_name(rank)

    def shard_info(self, rank: int) -> FileInfo:
        return FileInfo(self.shards[rank]["size"], self.shards[rank]["sha256"])

    def verify(self) -> None:
        """CheckpointError unless every shard file is whole and the one recorded here."""
        for rank in range(len(self.shards)):
            file_info(self.shard_file(rank), self.shard_info(rank))


def write_manifest(directory: Path, step: int, job: dict, shards: list[dict], worker_steps: list[int],
                   positions: list[int]) -> None:
    """Mark the checkpoint in `directory` complete; call once every shard file is written."""
    write_json_atomic(Path(directory) / MANIFEST, {
        "format": FORMAT, "step": step, "job": job, "shards": shards, "worker_steps": worker_steps,
        "positions": positions})


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:  # (nesting deeper than the parser's recursion)
        raise CheckpointError(f"{path} is not JSON: {exc}") from None
    try:
        ckpt = Manifest(Path(directory), m["step"], m["job"], m["shards"], m["worker_steps"], m["positions"])
        ok = (m["format"] == FORMAT and _counts([ckpt.step, *ckpt.worker_steps, *ckpt.positions])
              and isinstance(ckpt.job, dict) and len(ckpt.worker_steps) == len(ckpt.positions) > 0
              and len(ckpt.shards) > 0 and all(_counts([s["size"], s["version"], *s["range"]])
                                               and isinstance(s["sha256"], str) for s in ckpt.shards))
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is malformed: {exc!r} missing or wrong") from None
    if not ok:
        raise CheckpointError(f"{path} is malformed")
    return ckpt


def _counts(values) -> bool:
    return all(type(v) is int and v >= 0 for v in values)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every checkpoint directory under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)


def newest_complete(root: Path) -> tuple[Manifest | None, list[str]]:
    """The newest checkpoint whose manifest exists and whose files all verify, and why
    each newer one was passed over."""
    skipped = []
    for step, path in reversed(_step_dirs(root)):
        if not (path / MANIFEST).exists():
            skipped.append(f"{path}: incomplete (no manifest)")
            continue
        try:
            ckpt = read_manifest(path)
            if ckpt.step != step:
                raise CheckpointError(f"{path / MANIFEST} is for step {ckpt.step}")
            ckpt.verify()
            return ckpt, skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    return None, skipped


def prune(root: Path, keep: int = KEEP, after: int = -1) -> list[Path]:
    """Delete the checkpoint directories older than the `keep` newest with a manifest
    (incomplete ones among them too; newer ones may still be being written), of those
    after step `after` only: a resumed job's writes. What an earlier run left is not
    this run's to judge."""
    dirs = _step_dirs(root)
    complete = [step for step, path in dirs if (path / MANIFEST).exists()]
    if len(complete) < keep:
        return []
    paths = [path for step, path in dirs if after < step < complete[-keep]]
    for path in paths:
        shutil.rmtree(path)
    return paths


def set_aside_after(root: Path, step: int) -> list[tuple[Path, Path]]:
    """Rename the checkpoint directories newer than `step` (a resumed job's abandoned
    future, which resuming passed over) out of its way: to step-N.set-aside-incomplete
    (no manifest) or step-N.set-aside-unverified (a file did not check out when it was
    read: damaged, or only unreadable then). They are kept as evidence, or to be
    renamed back. Returns (old, new) paths."""
    moved = []
    for s, path in _step_dirs(root):
        if s > step:
            why = "unverified" if (path / MANIFEST).exists() else "incomplete"
            target = _unused(path.with_name(f"{path.name}.set-aside-{why}"))
            path.rename(target)
            moved.append((path, target))
    return moved


def _unused(path: Path) -> Path:
    """`path`, or path-2, path-3, ...: the first that does not exist (a run resumed twice)."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
