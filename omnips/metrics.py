"""The run directory: config.json, metrics.jsonl (one event per line), summary.json."""

import json
import logging
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

from .eventlog import EventLog

log = logging.getLogger("omnips.scheduler")


def finite(obj):
    """`obj` with NaN and infinities replaced by None: JSON has no words for them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` durable (a rename or a new file survives a crash)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path, mode: str = "w"):
    """A file to write `path` through: a temporary sibling, fsynced and renamed over `path`
    (the directory fsynced) when the block ends, so that readers see the old or the new
    file whole and the new one survives a crash. A failed write removes it: a full disk
    is left no fuller."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj) -> None:
    with atomic_file(path) as f:
        json.dump(finite(obj), f, indent=2, allow_nan=False)
        f.write("\n")


class RunDirInUse(RuntimeError):
    pass


class RunDir:
    def __init__(self, path: str | Path, clock=time.monotonic, resume: bool = False):
        """A new run directory; with `resume`, the directory of an interrupted run, whose
        metrics.jsonl is continued (its event times too) and whose summary is dropped."""
        self.path = Path(path)
        self.clock = clock
        self.t0 = clock()
        events = self.path / "metrics.jsonl"
        if resume:
            self.t0 -= _continue_events(events)
            (self.path / "summary.json").unlink(missing_ok=True)
        else:
            used = [name for name in ("metrics.jsonl", "summary.json") if (self.path / name).exists()]
            if used:
                raise RunDirInUse(f"run directory {self.path} already holds a run ({used[0]}): "
                                  "choose another --run-dir")
            self.path.mkdir(parents=True, exist_ok=True)
        self._events = EventLog(events, new=not resume)
        self.watchers: list = []  # objects with add(event) and close(), given every event (TensorBoard)

    def write_config(self, config: dict) -> None:
        write_json_atomic(self.path / "config.json", config)

    def event(self, kind: str, **fields) -> None:
        record = {"event": kind, "t": round(self.clock() - self.t0, 6), **fields}
        try:  # as a rule every number is finite: no walk through the record (the scheduler writes one a report)
            line = json.dumps(record, allow_nan=False)
        except ValueError:
            line = json.dumps(finite(record), allow_nan=False)
        self._events.append(line)
        for watcher in list(self.watchers):
            try:
                watcher.add(record)
            except Exception as exc:  # a side output (a full disk, say) must not end the job
                self.watchers.remove(watcher)
                log.warning("stopped writing %s: %s", type(watcher).__name__, exc)

    def step(self, r, epoch: float, disturbed: bool = False) -> None:
        """A worker's report (protocol.Report) as its `step` line, at the job's `epoch`;
        `disturbed` (written only when true): it overlapped an evaluation or a checkpoint
        write, and dynamic batching did not measure it."""
        extra = {"disturbed": True} if disturbed else {}
        self.event("step", worker=r.rank, step=r.step, batch=r.batch, epoch=epoch, compute_s=r.compute_s,
                   network_s=r.network_s, wait_s=r.wait_s, overhead_s=r.overhead_s, loss=r.loss, staleness=r.staleness,
                   mem_batch=r.mem_batch, mem_free=r.mem_free, sample_bytes=r.sample_bytes, **extra)

    def flush(self) -> None:
        self._events.flush()

    @property
    def events_lost(self) -> int:
        """Events not in metrics.jsonl (yet): its writes failed (a full disk)."""
        return self._events.lost

    def write_summary(self, summary: dict) -> None:
        self.flush()
        write_json_atomic(self.path / "summary.json", summary)

    def close(self) -> None:
        self._events.close()
        for watcher in self.watchers:
            watcher.close()


def _continue_events(path: Path) -> float:
    """Cut a line torn by a crash off the end of metrics.jsonl (an event appended to it
    would be lost with it); returns the time of the last whole event. ValueError, and the
    file left as it was, if that event is not one this code wrote."""
    with open(path, "rb+") as f:
        data = f.read()
        whole = data.rfind(b"\n") + 1
        lines = data[:whole].splitlines()
        t = _event_time(path, lines[-1]) if lines else 0.0
        f.truncate(whole)
    return t


def _event_time(path: Path, line: bytes) -> float:
    """The time `t` of an event line of `path`; a damaged or edited one raises ValueError."""
    try:
        event = json.loads(line)
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"cannot continue {path}: its last line is not JSON ({exc})") from None
    t = event.get("t") if isinstance(event, dict) else None
    if type(t) not in (int, float) or not 0 <= t < math.inf:
        raise ValueError(f"cannot continue {path}: its last line is not an event with a time t >= 0")
    return t


def read_events(path: str | Path) -> list[dict]:
    """The events of a run directory's metrics.jsonl, line i+1 in place i. A last line
    without its newline (being written, or torn by a crash) is left out; any other line
    that holds no event is ValueError naming the file and line."""
    path = Path(path) / "metrics.jsonl"
    events = []
    for number, line in enumerate(path.read_bytes().split(b"\n")[:-1], 1):
        try:
            events.append(_event(line))
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: {exc}") from None
    return events


def _event(line: bytes) -> dict:
    try:
        event = json.loads(line.decode())
    except (ValueError, RecursionError) as exc:  # (UnicodeDecodeError too; nesting too deep)
        raise ValueError(f"not a JSON line ({exc})") from None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise ValueError('not an event (a JSON object with an "event" name)')
    return event
