"""metrics.jsonl's writer: events wait in memory and reach the file in batches. A write
that fails (a full disk, a quota) holds them back instead of ending the process: they
are written once the file takes them again, up to `held_max` bytes of them; later
ones are dropped and counted. A line only partly written when the file is closed is
cut off, so the file never ends torn."""

import logging
import os
from pathlib import Path

log = logging.getLogger("omnips.metrics")

HELD_MAX = 64 << 20  # bytes of events held while the file cannot be written
BATCH = 1 << 16  # bytes of events gathered before a write


class EventLog:
    def __init__(self, path: Path, new: bool, held_max: int = HELD_MAX, batch: int = BATCH):
        """Append to `path`; `new`: create it, refusing one that exists."""
        self.path, self.held_max, self.batch = Path(path), held_max, batch
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_EXCL if new else 0), 0o644)
        self._pending = bytearray()
        self._partial = 0  # bytes of a line partly written at the end of the file
        self.failure: OSError | None = None  # why the last write failed, until one succeeds
        self.dropped = 0  # events not held: held_max was reached

    def append(self, line: str) -> None:
        data = line.encode() + b"\n"
        if len(self._pending) + len(data) > self.held_max:
            if not self.dropped:
                log.error("%s: %d MiB of events wait to be written; later ones are dropped (counted in the summary)",
                          self.path, self.held_max >> 20)
            self.dropped += 1
            return
        self._pending += data
        if self.failure is None and len(self._pending) >= self.batch:
            self.flush()  # failing, the next try is the caller's next flush(), not every event

    def flush(self) -> None:
        while self._pending:
            try:
                n = os.write(self._fd, self._pending)
            except OSError as exc:
                if self.failure is None:
                    log.warning("cannot write %s: %s; events wait in memory (up to %d MiB) until it can be written",
                                self.path, exc, self.held_max >> 20)
                self.failure = exc
                return
            newline = self._pending.rfind(b"\n", 0, n)
            self._partial = self._partial + n if newline < 0 else n - newline - 1
            del self._pending[:n]
        if self.failure is not None:
            log.info("%s written again: the events that waited are in it", self.path)
            self.failure = None

    @property
    def lost(self) -> int:
        """Events that are not in the file: dropped, or still waiting."""
        return self.dropped + self._pending.count(b"\n")

    def close(self) -> None:
        self.flush()
        if self._pending:
            if self._partial:  # a reader would take the torn line for damage
                os.ftruncate(self._fd, os.fstat(self._fd).st_size - self._partial)
            log.error("%d events could not be written to %s (%s)", self.lost, self.path, self.failure)
        elif self.dropped:
            log.error("%d events were dropped from %s while it could not be written", self.dropped, self.path)
        os.close(self._fd)
