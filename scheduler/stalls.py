"""Which rank the job waits for: a stalled step named with its rank, host and device.

Pure logic, fed with the workers' reports and heartbeats and the time. A worker's
heartbeat, while it waits for the servers' answers to its push, says for which step,
for how long and which servers have not answered (omnips.protocol.Heartbeat). Then:

- BSP: the step in flight waits for the workers that are not waiting at it (one stopped,
  or slow); when every worker waits, for a server that none has heard from.
- ASP/SSP: nobody waits for anyone (SSP: only at its bound); the worker furthest behind
  is named once its last report is a few step times old.

A wait is named once it passes STALL_STEPS typical step times (the median interval
between a worker's reports) and one heartbeat interval, so that the usual spread of a
step's arrivals says nothing; and the rank named must have been silent for QUIET_BEATS
heartbeat intervals (stopped, or computing: the heartbeats a worker sends while it
computes a step count as silence here), so that one whose heartbeat saying it waits is
still on its way is not blamed. `waiting(now)` is the fact (a status page can read it);
`notice(now)` decides what the scheduler logs: the wait when it is first named, again
every NOTICE_S while it lasts, and that it ended.
"""

import statistics
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

STALL_STEPS = 3
QUIET_BEATS = 1.5
LOOK_S = 0.1  # notice() looks at most this often: waiting() visits every worker
NOTICE_S = 5.0


class Wait(NamedTuple):
    step: int
    rank: int
    host: str
    device: str  # a server's: ""
    seconds: float  # how long the step has waited
    role: str = "worker"

    def __str__(self) -> str:
        where = f"{self.host}, {self.device}" if self.device else self.host
        return f"step {self.step} waits for {self.role} {self.rank} ({where}) for {self.seconds:.1f} s"


@dataclass
class _Waiting:
    step: int
    since: float
    servers: tuple[int, ...]


class StallWatch:
    def __init__(self, mode: str, heartbeat_s: float):
        self.bsp = mode == "bsp"
        self.heartbeat_s = heartbeat_s
        self.workers: dict[int, tuple[str, str]] = {}  # rank -> (host, device), present ones
        self.servers: dict[int, str] = {}  # rank -> host
        self._reported: dict[int, tuple[int, float]] = {}  # rank -> (last step reported, when)
        self._heard: dict[tuple[str, int], float] = {}  # (role, rank) -> when it last reported or beat
        self._waiting: dict[int, _Waiting] = {}
        self._intervals: dict[int, deque[float]] = {}  # rank -> its latest intervals between reports
        self._named: Wait | None = None  # the wait last logged, until it ends
        self._told_at = 0.0
        self._next_look = 0.0

    # -- events ---------------------------------------------------------------------
    def seat(self, rank: int, host: str, device: str, now: float) -> None:
        self.workers[rank] = (host, device)
        self._reported[rank] = (-1, now)
        self._heard["worker", rank] = now

    def leave(self, rank: int) -> None:
        """A worker lost, or done: nothing waits for it."""
        self.workers.pop(rank, None)
        self._reported.pop(rank, None)
        self._waiting.pop(rank, None)

    def on_report(self, rank: int, step: int, now: float) -> None:
        last = self._reported.get(rank)
        if last is not None and last[0] >= 0 and step == last[0] + 1:
            self._intervals.setdefault(rank, deque(maxlen=16)).append(now - last[1])
        self._reported[rank] = (step, now)
        self._heard["worker", rank] = now
        w = self._waiting.get(rank)
        if w is not None and w.step <= step:
            del self._waiting[rank]

    def on_beat(self, rank: int, step: int, waited_s: float, servers: list[int], now: float) -> None:
        """A worker's heartbeat: waiting for the servers' answers to its push of `step`
        (step >= 0 with servers unanswered), computing `step` (no servers), or neither."""
        reported = self._reported.get(rank, (-1, now))[0]
        if step < 0 or servers:  # one still computing may be what the others wait for
            self._heard["worker", rank] = now
        if step >= 0 and servers and step > reported:
            self._waiting[rank] = _Waiting(step, now - waited_s, tuple(servers))
        else:
            self._waiting.pop(rank, None)

    def on_server_beat(self, rank: int, now: float) -> None:
        self._heard["server", rank] = now

    # -- the fact -------------------------------------------------------------------
    def threshold_s(self, rank: int | None = None) -> float:
        """How long a wait must be to be named: STALL_STEPS step times of worker `rank` (ASP:
        each worker at its own pace), or of them all, and a heartbeat interval at least."""
        own = self._intervals.get(rank)
        times = list(own) if own else [t for d in self._intervals.values() for t in d]
        return max(STALL_STEPS * statistics.median(times) if times else 0.0, self.heartbeat_s)

    def waiting(self, now: float) -> Wait | None:
        """The rank the job waits for, the step and for how long; None when nothing waits
        longer than a few step times."""
        limit = self.threshold_s()
        quiet = QUIET_BEATS * self.heartbeat_s

        def silent(role: str, rank: int) -> bool:
            return now - self._heard.get((role, rank), 0.0) > quiet

        waits = {r: w for r, w in self._waiting.items() if r in self.workers}
        if waits and len(waits) == len(self.workers):  # every worker waits: for a server
            common = set.intersection(*(set(w.servers) for w in waits.values()))
            step = max(w.step for w in waits.values())
            since = min(w.since for w in waits.values())
            held = [s for s in sorted(common) if silent("server", s)]
            if held and now - since > limit:
                return Wait(step, held[0], self.servers.get(held[0], "?"), "", now - since, "server")
            return None
        if self.bsp:
            if not waits:
                return None
            step = max(w.step for w in waits.values())
            since = min(w.since for w in waits.values() if w.step == step)
            behind = [r for r in sorted(self.workers)
                      if r not in waits and self._reported[r][0] < step and silent("worker", r)]
            if not behind or now - since <= limit:
                return None
            return self._worker(step, behind[0], now - since)
        rank = min((r for r in self.workers if r not in waits), key=lambda r: self._reported[r], default=None)
        if rank is None:
            return None
        step, at = self._reported[rank]
        if now - at > self.threshold_s(rank) and silent("worker", rank):
            return self._worker(step + 1, rank, now - at)
        return None

    def _worker(self, step: int, rank: int, seconds: float) -> Wait:
        host, device = self.workers[rank]
        return Wait(step, rank, host, device, seconds)

    # -- what to say ----------------------------------------------------------------
    def notice(self, now: float) -> tuple[str, Wait] | None:
        """("waits", wait) when a wait is first named and every NOTICE_S while it lasts;
        ("went on", the last wait named) once it has ended; else None."""
        if now < self._next_look:
            return None
        self._next_look = now + LOOK_S
        wait = self.waiting(now)
        named = self._named
        if wait is None or named is not None and (wait.role, wait.rank, wait.step) != (named.role, named.rank,
                                                                                          named.step):
            self._named = None
            if named is not None:
                return "went on", named._replace(seconds=named.seconds + (now - self._told_at))
            return None
        if named is None or now - self._told_at >= NOTICE_S:
            self._named, self._told_at = wait, now
            return "waits", wait
        return None
