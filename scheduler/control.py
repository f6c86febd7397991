"""Dynamic batching: measure each worker over a window, re-plan, hand out the new plan.

Pure logic: `on_step` takes a worker's reported compute time; when every worker
has a full window at its current batch, `replan` fits the time models and asks
the controller (omnips/batching.py) for the next batch vector. A worker's first
step at a new batch size is not measured (it pays for warming up). Reports
still at an older batch (ASP workers switch at their next reply) are ignored.

A report costs O(1) (the scheduler asks `ready` after each), a decision a few
numpy operations over all workers: the models' predictions at the plan's batches
are kept from one decision to the next for the per-report change check.
"""

import statistics
from dataclasses import dataclass

import numpy as np

from omnips.batching import BatchPlan, Decision, decide, spread
from omnips.job import JobSpec
from omnips.timemodel import CHANGE, TimeModels

CHANGE_STEPS = 3  # consecutive far-off steps that trigger an early re-plan
# a plan the deadband holds back, proposed by this many decisions running and predicted this
# much faster, is taken: the deadband stops noise from churning the plan, not a lasting gain
PERSIST = 3
MIN_GAIN = 0.01
# as are held-back plans predicted this much faster that many decisions running, whichever they
# are: from tens of workers on, the worst of many models' errors moves a sample or two from one
# decision to the next, so that the same plan rarely comes up twice (at 64 workers the plan
# stayed 2 % off the best one for good)
WIDE_GAIN = 0.02
RAN_PLANS = 8  # the plans whose measured step time is kept: a held-back plan measured slower stays held


@dataclass(frozen=True)
class Adjustment:
    decision: Decision
    times: tuple[float, ...]  # each worker's measured (median) compute time in the window
    batches: tuple[int, ...]  # the batches those times were measured at
    reason: str


class BatchControl:
    def __init__(self, job: JobSpec, plan: BatchPlan):
        self.job = job
        n = job.num_workers
        self.models = TimeModels(n, affine=job.controller == "affine")
        lo, hi = job.batch_bounds
        self.min_batch = lo
        self.hard_max = [hi] * n  # the job's bound, --max-batch on the worker, an out-of-memory step: only falls
        self.memory_max: list[int | None] = [None] * n  # from the worker's free memory: follows it
        self._bounds = np.full(n, hi, dtype=np.int64)  # the lower of the two, kept current
        self._window = [[] for _ in range(n)]
        self._median = np.zeros(n)  # of each window
        self._measured_batch: list[int | None] = [None] * n
        self._stepped = np.zeros(n, dtype=bool)  # measured in a window of real steps (not only probed)
        self.adjustments = 0
        self._ran: dict[tuple[int, ...], float] = {}  # plan -> its newest window's slowest median, oldest first
        self._plan: BatchPlan | None = None
        self.plan = plan

    @property
    def plan(self) -> BatchPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: BatchPlan) -> None:
        """A new plan (decided here, or handed out by the scheduler): a window measured at
        another batch is dropped, and what the change check predicts is refreshed. The plan
        in force handed out again (the scheduler sends each plan `replan` set) changes nothing."""
        if plan == self._plan:
            return
        batches = np.asarray(plan.batches)
        if self._plan is not None:
            for rank in np.flatnonzero(self._batches != batches).tolist():
                self._window[rank].clear()
        self._plan, self._batches = plan, batches
        self._active = np.flatnonzero(batches)
        # (the plan held back last, decisions in a row proposing it, decisions in a row proposing any at WIDE_GAIN)
        self._held_back: tuple[tuple[int, ...] | None, int, int] = (None, 0, 0)
        self._expect()

    def _expect(self) -> None:
        """Each worker's predicted time at its planned batch, where the model is trusted
        there (nan elsewhere), and which windows are full or show a change."""
        batches = self._batches
        self._predicted = np.full(len(batches), np.nan)
        ranks = np.flatnonzero(self.models.measured(np.arange(len(batches))) & (batches > 0))
        trusted = ranks[self.models.trusted_at(ranks, batches[ranks])]
        self._predicted[trusted] = self.models.predict(trusted, batches[trusted])
        self._full: set[int] = set()
        self._changing: set[int] = set()
        for rank in np.flatnonzero(self._lengths()).tolist():
            self._track(rank)  # (only a rank in the plan has a window)

    def _lengths(self) -> np.ndarray:
        return np.fromiter(map(len, self._window), dtype=np.int64, count=len(self._window))

    @property
    def active(self) -> list[int]:
        """The ranks the plan gives a batch: the workers in the job."""
        return self._active.tolist()

    def on_step(self, rank: int, batch: int, compute_s: float) -> None:
        if batch != self.plan.batches[rank] or not batch or not compute_s > 0:
            return  # still on an older plan
        if self._measured_batch[rank] != batch:
            self._measured_batch[rank] = batch  # first step at this size: warm-up, not measured
            self._window[rank].clear()
            self._track(rank)
            return
        window = self._window[rank]
        typical = self._median[rank] if window else None
        if typical is not None and abs(compute_s - typical) > CHANGE * typical:
            # the worker's speed changed inside the window: a median across the change would be
            # a time it never had (and a fit through it a wrong slope): start the window anew
            window.clear()
        window.append(compute_s)
        self._median[rank] = statistics.median(window)
        self._track(rank)

    def _track(self, rank: int) -> None:
        """Whether `rank`'s window is full (one measured step for a worker never measured
        yet), and whether it shows a change of speed: its last CHANGE_STEPS measurements
        all miss its model's trusted prediction by more than CHANGE."""
        window = self._window[rank]
        # a worker never measured in real steps (the job's start, a joiner) is judged on its
        # first measured step: the plan it is on is a guess (at best from probe passes far
        # smaller than its batch), and its first move is large enough for one sample
        need = self.job.adjust_every - 1 if self._stepped[rank] else 1
        if len(window) >= need:
            self._full.add(rank)
        else:
            self._full.discard(rank)
        predicted = self._predicted[rank]
        if len(window) >= CHANGE_STEPS and all(abs(t - predicted) > CHANGE * predicted
                                                for t in window[-CHANGE_STEPS:]):
            self._changing.add(rank)  # (a nan prediction, untrusted, misses nothing)
        else:
            self._changing.discard(rank)

    @property
    def ready(self) -> bool:
        """Every worker has a full window, or one worker's speed has clearly changed."""
        return len(self._full) == len(self._active) or bool(self._changing)

    def replan(self, reason: str = "window", active: list[int] | None = None) -> Adjustment:
        """Feed the windows to the time models and decide for the `active` ranks (default:
        those in the plan); the plan changes unless the decision falls inside the deadband,
        which a memory limit or a change of membership does not wait for."""
        batches = self.plan.batches
        n = len(batches)
        measured = np.flatnonzero(self._lengths())
        times = np.zeros(n)
        times[measured] = self._median[measured]
        self.models.observe(measured, self._batches[measured], times[measured])
        self._stepped[measured] = True
        if len(measured) == len(self._active):
            self._remember(batches, float(times.max()))
        for window in self._window:
            window.clear()  # in place: 4096 new lists cost more (the collector runs) than clearing
        ranks = np.asarray(self._active if active is None else active, dtype=np.int64)
        # a worker above its bound (memory, membership, a bound set with the probes) moves whatever
        # the deadband says
        over = bool(np.any(self._batches[ranks] > self._bounds[ranks]))
        sub = decide(self._batches[ranks], self._lines(ranks), self.job.global_batch,
                     self.min_batch, self._bounds[ranks],
                     0.0 if over or reason in ("memory", "membership") else self.job.deadband)
        if self._persists(sub) and not self._ran_slower(spread(sub.held, ranks, n), batches):
            sub, reason = Decision(sub.held, sub.targets, sub.held_s), "held"
        targets = np.zeros(n)
        targets[ranks] = sub.targets
        decision = Decision(None if sub.batches is None else spread(sub.batches, ranks, n),
                            tuple(targets.tolist()), sub.predicted_s)
        if decision.batches is not None and decision.batches != batches:
            self.adjustments += reason not in ("membership", "probe")
            self.plan = BatchPlan(self.plan.gen + 1, decision.batches)
        else:
            self._expect()  # the models moved: so do the predictions
        return Adjustment(decision, tuple(times.tolist()), tuple(batches), reason)

    def _persists(self, sub: Decision) -> bool:
        """Whether the plan the deadband held back has now been proposed PERSIST times running,
        each predicted MIN_GAIN faster than the plan in force, or PERSIST held-back plans running
        (whichever) each WIDE_GAIN faster. Noise proposes a different plan from one window to the
        next; a lasting gain (a transient slowdown over, leaving the plan a few % off) proposes
        the same one, or on many workers much the same one, which the deadband would otherwise
        hold off for good."""
        gain = sub.predicted_s / sub.held_s - 1 if sub.held is not None else 0.0
        last, same, wide = self._held_back
        same = same + 1 if gain >= MIN_GAIN and sub.held == last else int(gain >= MIN_GAIN)
        wide = wide + 1 if gain >= WIDE_GAIN else 0
        self._held_back = (sub.held, same, wide)
        return same >= PERSIST or wide >= PERSIST

    def _remember(self, plan: tuple[int, ...], step_s: float) -> None:
        self._ran.pop(plan, None)
        self._ran[plan] = step_s
        if len(self._ran) > RAN_PLANS:
            del self._ran[next(iter(self._ran))]

    def _ran_slower(self, plan: tuple[int, ...], current: tuple[int, ...]) -> bool:
        """Whether `plan` ran before and its slowest worker was not measured MIN_GAIN faster
        than the current plan's. The models' predictions can be wrong the same way every
        window (a worker whose time is not a line in the batch): then they propose the same
        plan again and again, and without this it and the current plan would take turns for good."""
        return plan in self._ran and current in self._ran and self._ran[plan] * (1 + MIN_GAIN) > self._ran[current]

    def probed(self, points: dict[int, tuple[list, list]], memory: dict[int, int]) -> tuple[Adjustment, list[int]]:
        """The start plan from every worker's probe passes (rank -> their batch sizes and
        times): each worker's line through its probe points, within the batches its free
        memory holds (rank -> an estimate, as `estimate` takes), then a decision as after a
        window. Also the ranks whose memory estimate could not be applied."""
        ranks = np.asarray(sorted(points), dtype=np.int64)
        sizes = [points[int(r)] for r in ranks]
        for j in range(min(len(b) for b, _ in sizes)):
            self.models.observe(ranks, [b[j] for b, _ in sizes], [t[j] for _, t in sizes])
        refused = [rank for rank, bound in sorted(memory.items()) if not self._bound_memory(rank, bound)]
        adjustment = self.replan("probe")
        self._held_back = (None, 0, 0)  # the workers start on its plan: the windows count from there
        return adjustment, refused

    def resize(self, active: list[int]) -> Adjustment:
        """Workers left or joined: re-plan for `active` at once. A worker new to its rank
        starts with a fresh time model (taken meanwhile to be as fast as the typical one)."""
        joined = [rank for rank in active if not self.plan.batches[rank]]
        self.models.reset(joined)
        self._stepped[joined] = False
        for rank in joined:
            self._measured_batch[rank] = None
        self._ran.clear()  # the plans measured were another set of workers'
        return self.replan("membership", active)

    @property
    def max_batch(self) -> list[int]:
        return self._bounds.tolist()

    def _set_bound(self, rank: int) -> None:
        h, m = self.hard_max[rank], self.memory_max[rank]
        self._bounds[rank] = h if m is None else min(h, m)

    def limit(self, rank: int, max_batch: int) -> Adjustment | None:
        """A worker can hold at most `max_batch` samples in one pass (its --max-batch, or an
        out-of-memory step): lower its bound for good, and re-plan at once if its batch is
        now too large. ValueError when the workers together could no longer hold the global batch."""
        bound = max(self.min_batch, min(self.hard_max[rank], max_batch))
        if not self._holds(rank, min(bound, int(self._bounds[rank]))):
            raise ValueError(f"worker {rank} can hold only {max_batch} samples: the workers together cannot "
                             f"hold the global batch {self.job.global_batch}")
        self.hard_max[rank] = bound
        self._set_bound(rank)
        return self._enforce(rank)

    def estimate(self, rank: int, max_batch: int) -> tuple[bool, Adjustment | None]:
        """A worker's free memory holds about `max_batch` samples: bound it there (up or
        down), re-planning at once if its batch is over. An estimate that would leave the
        workers unable to hold the global batch is not applied (False): the worker then
        finds its real limit by running out of memory, and computes in chunks."""
        applied = self._bound_memory(rank, max_batch)
        return applied, self._enforce(rank) if applied else None

    def _bound_memory(self, rank: int, max_batch: int) -> bool:
        bound = max(self.min_batch, max_batch)
        if not self._holds(rank, min(bound, self.hard_max[rank])):
            return False
        self.memory_max[rank] = bound
        self._set_bound(rank)
        return True

    def _holds(self, rank: int, bound: int) -> bool:
        others = self._active[self._active != rank]
        return bound + int(self._bounds[others].sum()) >= self.job.global_batch

    def _enforce(self, rank: int) -> Adjustment | None:
        return self.replan("memory") if self.plan.batches[rank] > self._bounds[rank] else None

    def _lines(self, ranks: np.ndarray) -> np.ndarray:
        """The time models of the workers at `ranks`, an (n, 2) array. One never measured (it
        just joined) is taken to be as fast as the typical measured worker (the median line);
        when none is measured, each is taken to need the same time for its current batch (the
        plan is taken as balanced), or for an equal share of the global batch when it has none."""
        measured = self.models.measured(ranks)
        lines = np.zeros((len(ranks), 2))
        if measured.any():
            lines[measured] = self.models.lines(ranks[measured])
            if not measured.all():
                lines[~measured] = np.median(lines[measured], axis=0)
            return lines
        batches = self._batches[ranks]
        lines[:, 1] = 1.0 / np.where(batches > 0, batches, self.job.global_batch / len(ranks))
        return lines
