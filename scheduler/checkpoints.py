"""Checkpoints seen from the scheduler: when to take them, the servers' answers, the
manifest that marks one complete; and the run a resumed job continues.

BSP: a checkpoint every K steps, at the exact version K, 2K, ... on every shard
(asked in advance, like the evaluation pulls), so the shards form the model and
optimizer of one step. ASP/SSP: when the updates the workers reported cross a
multiple of K, every shard is written as soon as the request reaches it: the
shards' versions differ, and an update applied but not yet reported may be in a
shard while its worker resumes before it (that step is computed again).
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from omnips import checkpoint
from omnips.checkpoint import CheckpointError, Manifest
from omnips.job import MAX_INT, JobSpec, same_job
from omnips.protocol import Saved

log = logging.getLogger("omnips.scheduler")


@dataclass
class PendingCheckpoint:
    step: int
    worker_steps: list[int]
    positions: list[int]
    answers: dict[int, Saved] = field(default_factory=dict)  # server rank -> its answer


class CheckpointBook:
    def __init__(self, root: Path, job: JobSpec, ranges: list, every: int, start: int = 0):
        """`every` 0: none but those asked by hand (a preemption's)."""
        self.root, self.job, self.ranges, self.every = Path(root), job, ranges, every
        self.pending: dict[int, PendingCheckpoint] = {}
        self.complete = 0  # checkpoints this scheduler completed
        self._next_request = 0
        self.start = start  # the step the job started (resumed) from: checkpoints up to it are an earlier run's
        self._next_step = self._after(start)  # the first checkpoint after `start`

    def _after(self, step: int) -> int:
        return (step // self.every + 1) * self.every if self.every else MAX_INT

    def bsp_steps(self, total_steps: int) -> range:
        """The versions to checkpoint at; none at the end, which model.pt covers. (A range:
        --checkpoint-every 1 over millions of steps lists nothing.)"""
        return range(self._next_step, total_steps, self.every or 1)

    def due(self, updates: int) -> bool:
        """ASP/SSP: whether `updates` reported crosses the next multiple of the interval."""
        if updates < self._next_step:
            return False
        self._next_step = self._after(updates)
        return True

    def rewind(self, step: int) -> None:
        """The job went back to checkpoint `step`: what was asked after it will not come."""
        self.pending.clear()
        self._next_step = self._after(step)

    def abandon(self) -> list[int]:
        """The steps of the checkpoints in flight, no longer waited for."""
        steps = sorted(entry.step for entry in self.pending.values())
        self.pending.clear()
        return steps

    def open(self, step: int, worker_steps: list[int], positions: list[int]) -> int:
        self._next_request += 1
        self.pending[self._next_request] = PendingCheckpoint(step, list(worker_steps), list(positions))
        return self._next_request

    def add(self, server: int, msg: Saved) -> tuple[int, str | None] | None:
        """Record a server's answer; once all have answered, write the manifest and return
        (step, None), or (step, why the checkpoint is incomplete)."""
        entry = self.pending.get(msg.request)
        if entry is None or msg.step != entry.step:
            return None
        entry.answers[server] = msg
        if len(entry.answers) < len(self.ranges):
            return None
        del self.pending[msg.request]
        failed = [f"server {s}: {a.error}" for s, a in sorted(entry.answers.items()) if a.error]
        if failed:
            return entry.step, "; ".join(failed)
        try:
            self._record(entry)
        except (CheckpointError, OSError) as exc:
            return entry.step, str(exc)
        self.complete += 1
        return entry.step, None

    def _record(self, entry: PendingCheckpoint) -> None:
        directory = checkpoint.step_dir(self.root, entry.step)
        shards = []
        for s, (lo, hi) in enumerate(self.ranges):
            a = entry.answers[s]
            path = directory / checkpoint.shard_name(s)
            if not path.is_file() or path.stat().st_size != a.size:
                raise CheckpointError(f"server {s} wrote {path}, but the scheduler does not see it whole there "
                                      "(servers and scheduler must share the run directory's file system)")
            shards.append({"range": [lo, hi], "version": a.version, "size": a.size, "sha256": a.sha256})
        checkpoint.write_manifest(directory, entry.step, self.job.to_dict(), shards, entry.worker_steps,
                                  entry.positions)
        for path in checkpoint.prune(self.root, after=self.start):
            log.info("removed old checkpoint %s", path)


class ResumeError(ValueError):
    pass


def saved_job(run_dir: Path) -> JobSpec:
    """The job in RUN_DIR/config.json; ResumeError says why there is none."""
    try:
        return JobSpec.from_dict(json.loads((Path(run_dir) / "config.json").read_text()))
    except OSError as exc:
        raise ResumeError(f"cannot resume {run_dir}: no job there ({exc.strerror}: config.json)") from None
    except (ValueError, RecursionError) as exc:  # (JSONDecodeError, UnicodeDecodeError; nesting too deep)
        raise ResumeError(f"cannot resume {run_dir}: config.json: {exc}") from None


def resume_point(run_dir: Path) -> tuple[JobSpec, Manifest]:
    """The job of the run in `run_dir` and its newest complete checkpoint (its path
    absolute: servers started elsewhere read it)."""
    run_dir = Path(run_dir).resolve()
    job = saved_job(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise ResumeError(f"cannot resume {run_dir}: it holds no metrics.jsonl")
    summary = run_dir / "summary.json"
    if summary.exists():
        try:
            status = json.loads(summary.read_text())["status"]
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
            raise ResumeError(f"cannot resume {run_dir}: its summary.json is unreadable ({exc!r})") from None
        if status == "completed":
            raise ResumeError(f"cannot resume {run_dir}: its job completed")
    ckpt, skipped = checkpoint.newest_complete(run_dir / "checkpoints")
    for reason in skipped:
        log.warning("passed over a checkpoint: %s", reason)
    if ckpt is None:
        raise ResumeError(f"cannot resume {run_dir}: no complete checkpoint in {run_dir / 'checkpoints'} "
                          "(was it run with --checkpoint-every?)")
    if not same_job(ckpt.job, job):
        raise ResumeError(f"cannot resume {run_dir}: checkpoint {ckpt.path} belongs to another job than config.json")
    if len(ckpt.shards) != job.num_servers or len(ckpt.worker_steps) != job.num_workers:
        raise ResumeError(f"cannot resume {run_dir}: checkpoint {ckpt.path} does not fit the job's cluster size")
    if not _restart_point_fits(job, ckpt):
        raise ResumeError(f"cannot resume {run_dir}: checkpoint {ckpt.path} lists worker steps and positions that "
                          f"do not fit its step {ckpt.step} (remove it to resume from an older one)")
    return job, ckpt


def _restart_point_fits(job: JobSpec, ckpt: Manifest) -> bool:
    """Whether the manifest's worker steps and positions are ones Progress.restart_point
    gives at its step (read_manifest saw counts >= 0); others would have the workers wait
    for steps that never come. They travel in messages, as int64."""
    if max(ckpt.step, *ckpt.positions) > MAX_INT:
        return False
    if job.mode == "bsp":  # every worker at the version, reading the one stream from there
        return set(ckpt.worker_steps) == {ckpt.step} and set(ckpt.positions) == {ckpt.step * job.global_batch}
    return sum(ckpt.worker_steps) == ckpt.step  # the step of an asp/ssp checkpoint: the updates reported
