"""Pulls and checkpoint requests that wait at a shard: for its first values (a pull
before worker 0's init) or for the version they name (`at`: an evaluation's, a
checkpoint's). Pure bookkeeping: the shard core serves what this releases."""

from omnips.job import JobSpec
from omnips.protocol import Checkpoint, Pull

from .barrier import MAX_WAITING_PULLS

MAX_AHEAD = 1 << 40  # versions no job reaches: a thousand updates a second for 35 years


class Waiting:
    def __init__(self, job: JobSpec):
        self.job = job
        self.entries: list[tuple[bytes, Pull | Checkpoint, float]] = []  # (peer, request, arrival)

    def refusal(self, msg: Pull | Checkpoint, version: int, waits: bool) -> tuple[str, str] | None:
        """Why a pull or checkpoint is refused at `version`, as (code, text); None: it is
        served now, or (`waits`) in one of MAX_WAITING_PULLS places when the version reaches `at`."""
        if msg.at is not None and msg.at < version:
            return "version_passed", f"{msg.OP} at version {msg.at}, shard is at {version}"
        if msg.at is not None and msg.at > self.last_version(version):
            return "bad_version", f"{msg.OP} at version {msg.at}, which this job never reaches"
        if waits and len(self.entries) >= MAX_WAITING_PULLS:
            return "busy", f"{MAX_WAITING_PULLS} pulls are already waiting"
        return None

    def last_version(self, version: int) -> int:
        """The newest version a pull or checkpoint may wait for. With --max-steps the job
        ends there: a BSP version is a step, an ASP/SSP one an update, each applying at least
        one sample of the max_steps * global_batch the job trains on. Without it the job's
        length is the scheduler's to know (epochs of a dataset the server never loads):
        MAX_AHEAD versions ahead of `version`, which no job reaches, is the bound."""
        if self.job.max_steps is None:
            return version + MAX_AHEAD
        return self.job.max_steps * (1 if self.job.mode == "bsp" else self.job.global_batch)

    def add(self, peer: bytes, msg: Pull | Checkpoint, now: float) -> None:
        self.entries.append((peer, msg, now))

    def due(self, version: int) -> list[tuple[bytes, Pull | Checkpoint, float]]:
        """The requests to serve now that the shard holds `version`."""
        ready = [e for e in self.entries if e[1].at in (None, version)]
        self.entries = [e for e in self.entries if e[1].at not in (None, version)]
        return ready
