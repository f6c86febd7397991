"""What the scheduler's pure core asks its driver to do (scheduler/core.py decides,
scheduler/service.py carries it out, in order): messages to processes, requests to the
servers, evaluations, lines in the run's events, the end of the job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omnips.protocol import Checkpoint, Message, Report

if TYPE_CHECKING:
    from .evaluation import PendingEval


class JobFailed(RuntimeError):
    """Raised inside the core; it leaves as Finish(f"failed: {reason}")."""


@dataclass(frozen=True)
class Send:
    to: bytes  # a registered (or registering) peer on the scheduler's router
    msg: Message


@dataclass(frozen=True)
class ConnectServers:
    """Every shard has a server: open (again: `reconnect`) the sockets the evaluation and
    checkpoint requests travel on; what was asked on the old ones will not come."""

    reconnect: bool = False


@dataclass(frozen=True)
class AskEval:
    request: int
    at: int | None  # the version to read, None: as the servers hold it now


@dataclass(frozen=True)
class AskCheckpoint:
    msg: Checkpoint  # to every server


@dataclass(frozen=True)
class Evaluate:
    """Every shard of an evaluation is in: load it, write model.pt first when final, test it,
    then tell the core (SchedulerCore.evaluated)."""

    pending: PendingEval


@dataclass(frozen=True)
class WriteEvent:
    kind: str
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WriteStep:
    report: Report
    epoch: float
    disturbed: bool


@dataclass(frozen=True)
class Flush:
    """Push the buffered events to the file (once a heartbeat)."""


@dataclass(frozen=True)
class Finish:
    status: str  # "completed", "failed: why", "interrupted", "preempted"
    stopped: str | None = None  # what a stop saved


class Outbox(list):
    """The instructions of one event, in order; handed to the Planner as its `run`, so
    that its plans' events stay in order with the messages around them."""

    def send(self, to: bytes, msg: Message) -> None:
        self.append(Send(to, msg))

    def event(self, kind: str, **fields) -> None:
        self.append(WriteEvent(kind, fields))

    def take(self) -> list:
        out = list(self)
        self.clear()
        return out
