"""Who is alive, and whether the job moves: when each registered process was last heard
from and what its last heartbeat said it was doing, when the scheduler's own heartbeats
are due, and the job's timeouts (the cluster to form, the steps to be reported, the final
evaluation and the last checkpoints to be answered). Pure: the clock is passed in; a timeout
raises JobFailed, which the core turns into its Finish, but for the end's: finishing says it
has passed, and the core decides what it costs (scheduler/reports.end_overdue)."""

import logging

from .instructions import JobFailed

log = logging.getLogger("omnips.scheduler")

WAITING_SAY_S = 5.0  # while the cluster forms, how often the scheduler says who is still missing


class Liveness:
    def __init__(self, heartbeat_s: float, dead_after_s: float, register_timeout_s: float, stall_timeout_s: float,
                 server_timeout_s: float):
        self.heartbeat_s, self.dead_after_s = heartbeat_s, dead_after_s
        self.register_timeout_s, self.stall_timeout_s = register_timeout_s, stall_timeout_s
        self.server_timeout_s = server_timeout_s
        self.complete_at = 0.0  # when the cluster was complete: silences count from then at the earliest
        self._heard: dict[bytes, float] = {}  # registered peer -> when it last said anything
        self._phase: dict[bytes, str] = {}  # registered peer -> what its last heartbeat said it was doing
        self._next_beat = 0.0
        self._start: float | None = None  # the first tick
        self._waiting_said = 0.0  # when (s after the start) the scheduler last said who it waits for
        self._done_at: float | None = None  # when every worker was first seen done

    # -- the processes ------------------------------------------------------------
    def heard(self, peer: bytes, now: float) -> None:
        self._heard[peer] = now

    def on_beat(self, peer: bytes, phase: str) -> None:
        self._phase[peer] = phase

    def forget(self, peer: bytes) -> None:
        self._heard.pop(peer, None)

    def silent(self, peer: bytes, now: float) -> float:
        """Seconds since `peer` last said anything, counted from the cluster's completion at
        the earliest: until their welcome, processes beat at the default rate."""
        return now - max(self._heard.get(peer, 0.0), self.complete_at)

    def last_phase(self, peer: bytes) -> str:
        """What a silent member last said it was doing: at start-up, which phase it was in."""
        phase = self._phase.get(peer)
        return f", last heard {phase}" if phase else ""

    # -- the scheduler's own heartbeats ------------------------------------------------
    def beat_due(self, now: float) -> bool:
        return now >= self._next_beat

    def beaten(self, now: float) -> None:
        self._next_beat = now + self.heartbeat_s

    def own_silence(self, now: float) -> float | None:
        """Seconds since the scheduler's last heartbeats when longer than the processes wait for
        it (--dead-after and a heartbeat's grace): it was stalled (stopped, or starved of CPU) and
        they have given up on it; None before the first heartbeats or within that."""
        if not self._next_beat:
            return None
        silent = now - (self._next_beat - self.heartbeat_s)
        return silent if silent > self.dead_after_s + self.heartbeat_s else None

    # -- timeouts -----------------------------------------------------------------
    def forming(self, now: float, missing: str) -> None:
        """The cluster is not complete: say who is missing every WAITING_SAY_S, fail at --register-timeout."""
        if self._start is None:
            self._start = now
        waited = now - self._start
        if waited > self.register_timeout_s:
            raise JobFailed(f"cluster incomplete after {self.register_timeout_s:g} s: missing {missing}")
        if waited > self._waiting_said + WAITING_SAY_S:  # not only at the timeout
            self._waiting_said = waited
            log.info("waiting for %s (%.0f s of --register-timeout %g s)", missing, waited, self.register_timeout_s)

    def finishing(self, now: float) -> bool:
        """Every worker is done: whether the servers' timeout (120 s) has passed since, for them to
        answer the final evaluation's pulls and the checkpoints in flight."""
        if self._done_at is None:
            self._done_at = now
        return now - self._done_at > self.server_timeout_s

    def stalled(self, now: float, last_report: float | None) -> bool:
        """Whether no step was reported for --stall-timeout."""
        return now - (last_report or self.complete_at) > self.stall_timeout_s
