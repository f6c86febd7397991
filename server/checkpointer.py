"""A server's checkpoint files: snapshots written on a background thread, and the
restore of a shard from a checkpoint named in the welcome.

The core copies its state in the server's loop (shard.Snapshot); writing and
syncing the file, the slow part, runs on a thread while training goes on. One file
is written at a time: a snapshot that comes due while the previous one is still
being written waits for it (at most `wait_s`), so at most two copies of the state
exist. A failed write is answered as such: the checkpoint stays incomplete and the
server keeps serving.
"""

import logging
import socket
import threading
import time
from pathlib import Path

from omnips import checkpoint
from omnips.protocol import Saved

from .shard import Outgoing, ShardCore
from .shard_state import ShardState, Snapshot

log = logging.getLogger("omnips.server")

WAIT_S = 300.0


def load(core: ShardCore, step_dir: str, rank: int, lo: int, hi: int) -> int:
    """Restore `core` from server `rank`'s file of the checkpoint in `step_dir`, checked
    against the manifest; returns the restored version. CheckpointError / ValueError
    with a clear text when the file does not fit."""
    ckpt = checkpoint.read_manifest(Path(step_dir))
    if not 0 <= rank < len(ckpt.shards) or ckpt.shards[rank]["range"] != [lo, hi]:
        raise checkpoint.CheckpointError(f"checkpoint {step_dir} has no shard [{lo}, {hi}) for server {rank}")
    meta, arrays = checkpoint.read_shard(ckpt.shard_file(rank), ckpt.shard_info(rank))
    if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict) \
            or (meta.get("rank"), meta.get("range"), meta.get("step")) != (rank, [lo, hi], ckpt.step):
        raise checkpoint.CheckpointError(f"{ckpt.shard_file(rank)} holds another shard or step")
    core.restore(ShardState(meta["state"], arrays), next_steps=ckpt.worker_steps)
    return core.version


class ShardWriter:
    def __init__(self, root: Path, rank: int, lo: int, hi: int, wait_s: float = WAIT_S):
        self.root, self.rank, self.range, self.wait_s = Path(root), rank, [lo, hi], wait_s
        self._thread: threading.Thread | None = None
        self._job: tuple[Snapshot, dict] | None = None  # the write in progress and its outcome

    def submit(self, snap: Snapshot) -> list[Outgoing]:
        """Start writing `snap`; returns the answer to the previous write if it had to be
        waited for (or this one's, if the previous one is stuck)."""
        done = self.finished(wait_s=self.wait_s)
        if self._thread is not None:
            text = f"the previous checkpoint file is still being written after {self.wait_s:g} s"
            log.warning("checkpoint %d not written: %s", snap.step, text)
            return done + [self._answer(snap, {"error": text})]
        outcome: dict = {}
        self._job = (snap, outcome)
        self._thread = threading.Thread(target=self._write, args=(snap, outcome), name="checkpoint", daemon=True)
        self._thread.start()
        return done

    def finished(self, wait_s: float = 0.0) -> list[Outgoing]:
        """The answer to the write in progress once it has ended (waiting up to `wait_s`)."""
        if self._thread is None:
            return []
        self._thread.join(wait_s)
        if self._thread.is_alive():
            return []
        snap, outcome = self._job
        self._thread = self._job = None
        return [self._answer(snap, outcome)]

    def _write(self, snap: Snapshot, outcome: dict) -> None:
        path = checkpoint.step_dir(self.root, snap.step) / checkpoint.shard_name(self.rank)
        meta = {"rank": self.rank, "range": self.range, "step": snap.step, "state": snap.state.meta}
        start = time.monotonic()
        try:
            info = checkpoint.write_shard(path, meta, snap.state.arrays)
        except Exception as exc:  # any failure leaves the checkpoint incomplete; the server goes on
            text = f"writing {path} failed: {exc}"
            where = f"server {self.rank} on {socket.gethostname()}"
            if isinstance(exc, OSError):  # a full disk, a quota: said in a line, once a checkpoint
                log.warning("%s: checkpoint %d not written: %s", where, snap.step, text)
            else:
                log.exception("%s: checkpoint %d not written: %s", where, snap.step, text)
            outcome.update(error=text, write_s=time.monotonic() - start)
            return
        log.info("checkpoint %d: wrote %s (%d bytes)", snap.step, path, info.size)
        outcome.update(size=info.size, sha256=info.sha256, write_s=time.monotonic() - start)

    def _answer(self, snap: Snapshot, outcome: dict) -> Outgoing:
        return Outgoing(snap.to, Saved(request=snap.request, step=snap.step, version=snap.state.meta["version"],
                                       **outcome))
