"""The worker's pure core: its state, and what it does next (events in, instructions out,
the clock passed in; no sockets, no torch). worker/service.py is its driver: it moves
the scheduler's messages and the servers' refusals in, asks `next` what to do, does it
(a step, a rewind's pull, a probe) and says when it is done.

States: registering (until its first step can start: the welcome, the model, the first
pull), probing (its timed passes sent, it waits for the start plan), training,
rewinding (a rewind is on its way or being applied), finished (its steps are done: it
waits for the scheduler to close the job) and done (the job closed or this worker failed:
`next` says which, for good).

A wait on the servers ends early when the core is `interrupted`: the scheduler ended the
job or took it back to a checkpoint, or a server refused us as a shard restored from a
checkpoint does before that rewind could be read (issue 23).
"""

import logging
from dataclasses import dataclass
from enum import Enum

from omnips.batching import BatchPlan
from omnips.protocol import Plan, Rewind, Shutdown

log = logging.getLogger("omnips.worker")

NOTICE_S = 5.0  # how often a long wait says again what it waits for
REWIND_PHASE = "waiting for the scheduler's rewind"  # our heartbeats' phase meanwhile


class State(Enum):
    REGISTERING = "registering"
    PROBING = "probing"
    TRAINING = "training"
    REWINDING = "rewinding"
    FINISHED = "finished"
    DONE = "done"


@dataclass(frozen=True)
class Limits:
    """How long each wait on the scheduler may last, in seconds."""

    start_plan_s: float  # for the start plan, once the probe is sent (--welcome-timeout)
    rewind_s: float  # for a rewind a restored shard's refusal announced (--server-timeout)
    close_s: float  # for the end of the job, once this worker's steps are done (--server-timeout)


# -- instructions: what the driver does next ------------------------------------
@dataclass(frozen=True)
class Join:
    """Take the servers' values (worker 0 of a new job first gives them their own), then `joined`."""


@dataclass(frozen=True)
class SendProbe:
    """Time the probe's passes and send them to the scheduler, then `probed`."""


@dataclass(frozen=True)
class Step:
    """Compute, push and pull step `step` of `batch` samples (ASP: from stream `position`), then `stepped`."""

    step: int
    batch: int
    position: int


@dataclass(frozen=True)
class Listen:
    """Nothing to do but hear the scheduler (and tick): our heartbeats say `phase`."""

    phase: str = ""


@dataclass(frozen=True)
class GoBack:
    """Connect to the rewind's servers and pull the checkpoint's values, then `rewound`."""

    rewind: Rewind


@dataclass(frozen=True)
class Finish:
    """This worker's steps are done: tell the scheduler (a done report of `step`)."""

    step: int


@dataclass(frozen=True)
class Exit:
    """The scheduler closed the job: end with success."""


@dataclass(frozen=True)
class Fail:
    """End with `reason`; `cause`: "scheduler" (nothing to tell it) or "servers" (tell it why)."""

    reason: str
    cause: str


class WorkerCore:
    def __init__(self, host: str, limits: Limits):
        self.host, self.limits = host, limits
        self.state = State.REGISTERING
        self.rank, self.num_workers, self.bsp, self.total_steps = 0, 0, True, 0
        self.plan: BatchPlan | None = None
        self.probes = False  # this worker's first step is planned from its probe
        self.probe_sent = False
        self.start_plan: BatchPlan | None = None  # the scheduler's answer to the probes
        self.step, self.position = 0, 0  # the next step, and (ASP) its place in the sample stream
        self.rewind: Rewind | None = None  # REWINDING: the rewind to apply; None: awaited, or being applied
        self.applying: Rewind | None = None  # the rewind whose pull is under way
        self.refusal = ""  # the refusal that announced the awaited rewind
        self.since = self.told = 0.0  # when the current wait began, and when the log last said so
        self.outcome: Exit | Fail | None = None  # DONE: how it ends

    # -- events -------------------------------------------------------------------
    def welcomed(self, rank: int, num_workers: int, bsp: bool, total_steps: int, plan: BatchPlan,
                 start_step: int, start_position: int, probes: bool) -> None:
        self.rank, self.num_workers, self.bsp, self.total_steps = rank, num_workers, bsp, total_steps
        self.plan, self.step, self.position, self.probes = plan, start_step, start_position, probes

    def joined(self, step: int, plan: BatchPlan | None, now: float) -> None:
        """The servers' values are in (a joiner's pull may bring the step it starts at, and its plan)."""
        if self.state is not State.REGISTERING:
            return
        self.step, self.plan = step, plan or self.plan
        self.state, self.since = (State.PROBING if self.probes else State.TRAINING), now

    def probed(self, now: float) -> None:
        """The probe is sent: the start plan is awaited from now."""
        self.probe_sent, self.since = True, now

    def heard(self, msg, now: float) -> None:
        """A message from the scheduler (heartbeats, errors and failed shutdowns are the link's)."""
        if self.state is State.DONE:
            return
        if isinstance(msg, Shutdown):
            self._end(Exit())
        elif isinstance(msg, Rewind):
            self._rewind_heard(msg, now)
        elif isinstance(msg, Plan) and self.probes and self.start_plan is None and self.state in (
                State.REGISTERING, State.PROBING):  # (it may come before our probe left: we were late)
            self._start_plan(msg)

    def refused(self, refusal: str, code: str, now: float) -> bool:
        """A server refused our request (`refusal`: the error in words). True when a rewind on
        its way explains it: the step is abandoned and the rewind awaited; False: the
        refusal ends the worker (the driver raises it)."""
        if self.state is State.DONE or (self.state is State.REWINDING and self.applying is None):
            return True  # what we are about to leave anyway
        if not rewind_explains(code):
            return False
        self.state, self.rewind, self.applying = State.REWINDING, None, None
        self.refusal, self.since, self.told = refusal, now, now
        log.info("worker %d on %s: %s: %s", self.rank, self.host, refusal, REWIND_PHASE)
        return True

    def stepped(self, batch: int, plan: BatchPlan | None) -> None:
        """The step handed out is done (`plan`: the newest a server's reply carried)."""
        if self.state is not State.TRAINING:
            return
        self.step += 1
        if not self.bsp:
            self.position += batch
        self.plan = plan or self.plan

    def rewound(self, now: float) -> None:
        """The rewind handed out is applied: go on from its step."""
        if self.applying is None:
            return  # a newer rewind came meanwhile
        msg, self.applying = self.applying, None
        self.step, self.position = msg.steps[self.rank], msg.positions[self.rank]
        self.plan = msg.plan  # (its size checked when it came)
        self.state, self.since = State.TRAINING, now

    def tick(self, now: float) -> None:
        """The passing of time: the waits that give up."""
        waited = now - self.since
        if self.state is State.PROBING and self.probe_sent and self.start_plan is None \
                and waited > self.limits.start_plan_s:
            self._end(Fail(f"no start plan from the scheduler within {self.limits.start_plan_s:g} s (it waits for "
                           "every worker's probe)", "scheduler"))
        elif self.state is State.REWINDING and self.awaiting_rewind():
            if waited > self.limits.rewind_s:
                self._end(Fail(f"worker {self.rank} on {self.host}: {self.refusal}, but no rewind came from the "
                               f"scheduler within {self.limits.rewind_s:g} s", "servers"))
            elif now - self.told >= NOTICE_S:
                self.told = now
                log.warning("worker %d on %s: still %s (%.0f s, %g s at most)", self.rank, self.host, REWIND_PHASE,
                            waited, self.limits.rewind_s)
        elif self.state is State.FINISHED and waited > self.limits.close_s:
            self._end(Fail(f"finished, but the scheduler did not close the job within {self.limits.close_s:g} s",
                           "scheduler"))

    # -- decisions ----------------------------------------------------------------
    def next(self, now: float):
        """What the driver does now (one instruction)."""
        if self.state is State.DONE:
            return self.outcome
        if self.state is State.REGISTERING:
            return Join()
        if self.state is State.PROBING:
            if not self.probe_sent:
                return SendProbe()
            if self.start_plan is None:
                return Listen()
            self._take_start_plan()
        if self.state is State.REWINDING:
            if self.rewind is None:
                return Listen(REWIND_PHASE)
            self.applying, self.rewind = self.rewind, None
            return GoBack(self.applying)
        if self.state is State.FINISHED:
            return Listen()
        if self.plan.stop or (self.bsp and self.step >= self.total_steps):
            self.state, self.since = State.FINISHED, now
            return Finish(self.step)
        batch = self.plan.batches[self.rank]
        if not batch:
            return self._end(Fail(f"worker {self.rank} is no longer in the batch plan: the scheduler removed it",
                                  "scheduler"))
        return Step(self.step, batch, self.position)

    def interrupted(self) -> bool:
        """Whether a wait on the servers is to end now: what it waits for is abandoned."""
        return self.state is State.DONE or (self.state is State.REWINDING and self.applying is None)

    def awaiting_rewind(self) -> bool:
        return self.state is State.REWINDING and self.rewind is None and self.applying is None

    # -- helpers ------------------------------------------------------------------
    def _rewind_heard(self, msg: Rewind, now: float) -> None:
        if len(msg.steps) != self.num_workers:  # (its plan has one batch per step: Rewind.check)
            self._end(Fail(f"a rewind for {len(msg.steps)} workers, the job has {self.num_workers}", "scheduler"))
            return
        self.state, self.rewind, self.applying, self.since = State.REWINDING, msg, None, now

    def _start_plan(self, msg: Plan) -> None:
        try:
            self.start_plan = msg.plan.sized(self.num_workers)
        except ValueError as exc:
            self._end(Fail(f"the scheduler sent a bad start plan: {exc}", "scheduler"))

    def _take_start_plan(self) -> None:
        if self.start_plan.gen >= self.plan.gen:
            self.plan = self.start_plan
        self.state = State.TRAINING
        log.info("worker %d starts with batch %d (plan %d)", self.rank, self.plan.batches[self.rank], self.plan.gen)

    def _end(self, outcome: Exit | Fail):
        self.state, self.outcome = State.DONE, outcome
        return outcome


def rewind_explains(code: str) -> bool:
    """Whether a server's refusal is explained by a rewind on its way: bad_version is the
    answer of a shard behind the version it served us, one restored from a checkpoint
    whose rewind the scheduler sends once every server is back (we may read it later)."""
    return code == "bad_version"
