"""Dynamic batching: measure each worker over a window, re-plan, hand out the new plan.

Pure logic: `on_step` takes a worker's reported compute time; when every worker
has a full window at its current batch, `replan` fits the time models and asks
the controller (omnips/batching.py) for the next batch vector. A worker's first
step at a new batch size is not measured (it pays for warming up). Reports
still at an older batch (ASP workers switch at their next reply) are ignored.
"""

import statistics
from dataclasses import dataclass

from omnips.batching import BatchPlan, Decision, decide, spread
from omnips.job import JobSpec
from omnips.timemodel import CHANGE, TimeModel

CHANGE_STEPS = 3  # consecutive far-off steps that trigger an early re-plan


@dataclass(frozen=True)
class Adjustment:
    decision: Decision
    times: tuple[float, ...]  # each worker's measured (median) compute time in the window
    batches: tuple[int, ...]  # the batches those times were measured at
    reason: str


class BatchControl:
    def __init__(self, job: JobSpec, plan: BatchPlan):
        self.job = job
        self.plan = plan
        n = job.num_workers
        self.models = [TimeModel(affine=job.controller == "affine") for _ in range(n)]
        lo, hi = job.batch_bounds
        self.min_batch = lo
        self.hard_max = [hi] * n  # the job's bound, --max-batch on the worker, an out-of-memory step: only falls
        self.memory_max: list[int | None] = [None] * n  # from the worker's free memory: follows it
        self._window = [[] for _ in range(n)]
        self._measured_batch: list[int | None] = [None] * n
        self.adjustments = 0

    @property
    def active(self) -> list[int]:
        """The ranks the plan gives a batch: the workers in the job."""
        return [r for r, b in enumerate(self.plan.batches) if b]

    def on_step(self, rank: int, batch: int, compute_s: float) -> None:
        if batch != self.plan.batches[rank] or not batch or not compute_s > 0:
            return  # still on an older plan
        if self._measured_batch[rank] != batch:
            self._measured_batch[rank] = batch  # first step at this size: warm-up, not measured
            self._window[rank] = []
            return
        window = self._window[rank]
        typical = statistics.median(window) if window else None
        if typical is not None and abs(compute_s - typical) > CHANGE * typical:
            # the worker's speed changed inside the window: a median across the change would be
            # a time it never had (and a fit through it a wrong slope): start the window anew
            window.clear()
        window.append(compute_s)

    @property
    def ready(self) -> bool:
        """Every worker has a full window, or one worker's speed has clearly changed:
        its last CHANGE_STEPS measurements all miss its model by more than CHANGE."""
        need = self.job.adjust_every - 1
        active = self.active
        return all(len(self._window[r]) >= need for r in active) or any(self._changed(r) for r in active)

    def _changed(self, rank: int) -> bool:
        window, model = self._window[rank], self.models[rank]
        if len(window) < CHANGE_STEPS or not model.trusted_at(self.plan.batches[rank]):
            return False
        predicted = model.predict(self.plan.batches[rank])
        return all(abs(t - predicted) > CHANGE * predicted for t in window[-CHANGE_STEPS:])

    def replan(self, reason: str = "window", active: list[int] | None = None) -> Adjustment:
        """Feed the windows to the time models and decide for the `active` ranks (default:
        those in the plan); the plan changes unless the decision falls inside the deadband,
        which a memory limit or a change of membership does not wait for."""
        batches = self.plan.batches
        times = []
        for rank, window in enumerate(self._window):
            if window:
                self.models[rank].observe(batches[rank], statistics.median(window))
            self._window[rank] = []
            times.append(statistics.median(window) if window else 0.0)
        active = self.active if active is None else active
        bounds = self.max_batch
        sub = decide([batches[r] for r in active], self._lines(active), self.job.global_batch,
                     self.min_batch, [bounds[r] for r in active],
                     0.0 if reason in ("memory", "membership") else self.job.deadband)
        n = len(batches)
        targets = [0.0] * n
        for r, t in zip(active, sub.targets):
            targets[r] = t
        decision = Decision(None if sub.batches is None else spread(sub.batches, active, n), tuple(targets),
                            sub.predicted_s)
        if decision.batches is not None and decision.batches != batches:
            self.plan = BatchPlan(self.plan.gen + 1, decision.batches)
            self.adjustments += reason != "membership"
        return Adjustment(decision, tuple(times), tuple(batches), reason)

    def resize(self, active: list[int]) -> Adjustment:
        """Workers left or joined: re-plan for `active` at once. A worker new to its rank
        starts with a fresh time model (taken meanwhile to be as fast as the typical one)."""
        for rank in active:
            if not self.plan.batches[rank]:
                self.models[rank] = TimeModel(affine=self.job.controller == "affine")
                self._measured_batch[rank] = None
        return self.replan("membership", active)

    @property
    def max_batch(self) -> list[int]:
        return [h if m is None else min(h, m) for h, m in zip(self.hard_max, self.memory_max)]

    def limit(self, rank: int, max_batch: int) -> Adjustment | None:
        """A worker can hold at most `max_batch` samples in one pass (its --max-batch, or an
        out-of-memory step): lower its bound for good, and re-plan at once if its batch is
        now too large. ValueError when the workers together could no longer hold the global batch."""
        bound = max(self.min_batch, min(self.hard_max[rank], max_batch))
        if not self._holds(rank, min(bound, self.max_batch[rank])):
            raise ValueError(f"worker {rank} can hold only {max_batch} samples: the workers together cannot "
                             f"hold the global batch {self.job.global_batch}")
        self.hard_max[rank] = bound
        return self._enforce(rank)

    def estimate(self, rank: int, max_batch: int) -> tuple[bool, Adjustment | None]:
        """A worker's free memory holds about `max_batch` samples: bound it there (up or
        down), re-planning at once if its batch is over. An estimate that would leave the
        workers unable to hold the global batch is not applied (False): the worker then
        finds its real limit by running out of memory, and computes in chunks."""
        bound = max(self.min_batch, max_batch)
        if not self._holds(rank, min(bound, self.hard_max[rank])):
            return False, None
        self.memory_max[rank] = bound
        return True, self._enforce(rank)

    def _holds(self, rank: int, bound: int) -> bool:
        bounds = self.max_batch
        return bound + sum(bounds[r] for r in self.active if r != rank) >= self.job.global_batch

    def _enforce(self, rank: int) -> Adjustment | None:
        return self.replan("memory") if self.plan.batches[rank] > self.max_batch[rank] else None

    def _lines(self, active: list[int]) -> list[tuple[float, float]]:
        """The `active` workers' time models, each fitted once; one never measured is assumed
        to take the cluster's typical time at its current batch (the plan it is on is taken
        as balanced), or at an equal share of the global batch when it has none (it just joined)."""
        fitted = {r: self.models[r].line() for r in active if self.models[r].newest is not None}
        typical = statistics.median(a + c * self.models[r].newest[0] for r, (a, c) in fitted.items()
                                    if self.plan.batches[r]) if fitted else 1.0
        share = self.job.global_batch / len(active)
        return [fitted[r] if r in fitted else (0.0, typical / (self.plan.batches[r] or share)) for r in active]
