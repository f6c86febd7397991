"""Dynamic batching: measure each worker over a window, re-plan, hand out the new plan.

Pure logic: `on_step` takes a worker's reported step time (compute and overhead: scheduler/planning.py;
scheduler/disturbance.py: if it overlapped an evaluation); when every worker has a full window at its current
batch, `replan` fits the time models and asks the controller (omnips/batching.py) for the next batch vector.
A worker's first step at a new batch size is not measured (it pays for warming up), nor
reports still at an older batch (ASP workers switch at their next reply).

On real, noisy machines four rules keep noise from locking a bad plan in: a step far off the worker's
window (how far: its own noise, scheduler/windows.py) is an outlier until CHANGE_STEPS in a row (one
past 2x) say its speed changed (then the others' latest steps count with it: a slowdown of the whole
host shows on some workers a step before others); a worker goes to the minimum batch (measured at
nothing larger again) only where its last window agreed with its model, else to half its batch;
workers the models cannot tell apart get the uniform split; and measured step times outrank the
models (scheduler/regret.py): the plan goes back to a plan measured faster. A worker whose steps
vary far more than the others' is planned short of its mean (scheduler/margins.py).

A report costs O(1) (the scheduler asks `ready` after each), a decision a few numpy operations over
all workers: the models' predictions at the plan's batches are kept for the change check.
"""

from dataclasses import dataclass, replace

import numpy as np

from omnips.batching import PROBE_NOISE, BatchPlan, Decision, alike, decide, spread
from omnips.job import JobSpec
from omnips.timemodel import CHANGE, TimeModels

from .bounds import BatchBounds
from .margins import described, noise_margins
from .regret import BACK_WINDOWS, REGRET, PlanMemory, Seen
from .windows import Windows, first_miss, host_pace

# steps in the first window of a worker never measured in real steps, and in the window of a plan decided
# on fewer of them (under CPU quotas a plan from one first step, a warm-up's, ran 14 steps 0.2 s a step
# from the next): their median outvotes one slow step (a probe plan went to [63, 1] on a 6x step). A
# worker's first two steps off its model's guess by windows.FIRST_MISS, to one side, re-plan at once, as a
# change of speed does (the probe was wrong, not a step: under CPU quotas its guesses were 0.3-1.9x the
# steps, and each step waited for ran on them); so do two at a batch its model has not measured near
# (replayed under CPU quotas, a worker given 16 samples ran 2.18 s on a guess of 1.13), and three there
# all slower by windows.FIRST_DRIFT
FIRST_WINDOW = 3
SHRINK = 0.5  # a worker goes to the minimum batch on one window's word only from below 1 / SHRINK times it
# a plan the deadband holds back, proposed by this many decisions running and predicted this much
# faster, is taken: the deadband stops noise from churning the plan, not a lasting gain
PERSIST = 3
MIN_GAIN = 0.01
# as are held-back plans predicted this much faster that many decisions running, whichever they are: from
# tens of workers on, the worst of many models' errors moves a sample or two from one decision to the
# next, and the same plan rarely comes up twice (at 64 workers it stayed 2 % off for good)
WIDE_GAIN = 0.02


@dataclass(frozen=True)
class Adjustment:
    decision: Decision
    times: tuple[float, ...]  # each worker's measured (median) step time in the window
    batches: tuple[int, ...]  # the batches those times were measured at
    reason: str
    rule: str = ""  # which rule decided, in words (the `assign` event and the log carry it)


class BatchControl:
    def __init__(self, job: JobSpec, plan: BatchPlan):
        self.job = job
        n = job.num_workers
        self.models = TimeModels(n, affine=job.controller == "affine")
        lo, hi = job.batch_bounds
        self.min_batch = lo
        self.bounds = BatchBounds(n, hi, lo, job.global_batch)
        self._bounds = self.bounds.array  # (the same array, kept current)
        self._windows = Windows(n)
        self.disturbances = self._windows.disturbances  # whether steps disturbed (an evaluation) are measured
        self._stepped = np.zeros(n, dtype=bool)  # measured in a window of real steps (not only probed)
        self._rough = False  # no full window has decided yet: the plan in force is a guess (see replan)
        self._hasty = False  # the plan in force was decided on fewer than FIRST_WINDOW first steps
        self._first_window = min(FIRST_WINDOW, job.adjust_every - 1)  # (a full window may be shorter)
        self._confirmed = np.zeros(n, dtype=bool)  # its last window agreed with its model's prediction
        self._seen = Seen(n)
        self._pace = 1.0  # how much slower the host runs than the models' times (windows.host_pace)
        self.adjustments = 0
        self.ran = PlanMemory()
        self._plan: BatchPlan | None = None
        self.plan = plan

    @property
    def plan(self) -> BatchPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: BatchPlan) -> None:
        """A new plan (decided here, or handed out by the scheduler): a window measured at another
        batch is dropped, and what the change check predicts is refreshed. The plan in force handed
        out again (the scheduler sends each plan `replan` set) changes nothing."""
        if plan == self._plan:
            return
        batches = np.asarray(plan.batches)
        if self._plan is not None:
            for rank in np.flatnonzero(self._batches != batches).tolist():
                self._windows.clear(rank)
        self._plan, self._batches = plan, batches
        self._active = np.flatnonzero(batches)
        # (the plan held back last, decisions in a row proposing it, decisions in a row proposing any at WIDE_GAIN)
        self._held_back: tuple[tuple[int, ...] | None, int, int] = (None, 0, 0)
        self._expect()

    def _expect(self) -> None:
        """Each worker's predicted time at its planned batch, where the model is trusted
        there (nan elsewhere), and which windows are full or show a change."""
        batches = self._batches
        self._guess = np.full(len(batches), np.nan)  # the models' time at the plan's batch, trusted or not
        ranks = np.flatnonzero(self.models.measured(np.arange(len(batches))) & (batches > 0))
        self._guess[ranks] = self.models.predict(ranks, batches[ranks]) * self._pace
        self._predicted = np.full(len(batches), np.nan)
        trusted = ranks[self.models.trusted_at(ranks, batches[ranks])]
        self._predicted[trusted] = self._guess[trusted]
        self._full: set[int] = set()
        self._measuring: set[int] = set()  # workers with a step in their window
        self._changing: set[int] = set()
        self._missed: set[int] = set()  # workers whose first steps missed their guess (first_miss)
        for rank in np.flatnonzero(self._windows.lengths()).tolist():
            self._track(rank)  # (only a rank in the plan has a window)

    @property
    def active(self) -> list[int]:
        """The ranks the plan gives a batch: the workers in the job."""
        return self._active.tolist()

    def on_step(self, rank: int, batch: int, seconds: float, disturbed: bool = False) -> None:
        if batch != self.plan.batches[rank] or not batch or not seconds > 0:
            return  # still on an older plan
        if self._windows.add(rank, batch, seconds, disturbed, self._predicted[rank]):
            self._track(rank)

    def _track(self, rank: int) -> None:
        """Whether `rank`'s window is full (FIRST_WINDOW measured steps for a worker never measured
        yet, or under a plan decided on fewer first steps: see FIRST_WINDOW), and whether it shows a
        change of speed: its last CHANGE_STEPS measurements (or those its window restarted from at a
        change), none its first at the batch (windows.SETTLE), all miss its model's trusted prediction
        by more than its tolerance, as measured and at the host's pace (Windows.changed; FIRST_WINDOW)."""
        window = self._windows[rank]
        # the job's start, a joiner, a hasty plan: see FIRST_WINDOW
        need = self._first_window if not self._stepped[rank] or self._hasty else self.job.adjust_every - 1
        (self._measuring.add if window else self._measuring.discard)(rank)
        (self._full.add if len(window) >= need else self._full.discard)(rank)
        guess = self._guess[rank]  # (a nan prediction or guess, untrusted or none, misses nothing)
        untried = not self._stepped[rank] or not np.isfinite(self._predicted[rank])  # see FIRST_WINDOW
        if untried and first_miss(self._windows.firsts(rank), guess):
            self._missed.add(rank)
        else:
            self._missed.discard(rank)
        if self._windows.changed(rank, self._predicted, guess):
            self._changing.add(rank)
        else:
            self._changing.discard(rank)

    def _changes(self) -> set[int]:
        """The workers whose speed changed (Windows.changed), and those whose first steps missed
        their guess (FIRST_WINDOW), at the host's pace once every worker has a step (four equal
        workers' first steps under CPU quotas ran 1.13, 1.19, 1.30 and 1.13x the probe's guesses:
        the 1.30, read as a miss, re-planned on that step and moved the plan 3 samples off)."""
        missed = self._windows.misses(self._missed, self._guess) if len(self._measuring) == len(self._active) else set()
        return self._changing | missed

    @property
    def ready(self) -> bool:
        """Every worker has a full window, or a worker's speed clearly changed (or its first steps
        missed its guess: FIRST_WINDOW) and every worker has a step in its window: a slower host
        is the host's pace, not the change of the one worker whose window ran across it (the others'
        restarted by a new plan: under CPU quotas the plan moved 10 samples off that worker)."""
        if len(self._full) == len(self._active):
            return True
        if not (self._changing or self._missed) or len(self._measuring) < len(self._active):
            return False
        return bool(self._changes())

    def replan(self, reason: str = "window", active: list[int] | None = None) -> Adjustment:
        """Feed the windows to the time models and decide for the `active` ranks (default: those in the
        plan): the equal-time plan, unless the deadband holds the plan in force (not for a memory limit
        or a change of membership), workers alike get the uniform split, or measured times outrank it."""
        batches = self.plan.batches
        n = len(batches)
        measured = np.flatnonzero(self._windows.lengths())
        times = np.zeros(n)
        times[measured] = self._windows.median[measured]
        changing = self._changes()
        if changing:
            self._windows.share_change(changing, self._guess, measured, times)
        trusted = measured[np.isfinite(self._predicted[measured])]
        self._pace *= host_pace(times[trusted] / self._predicted[trusted])
        norm = times / self._pace  # the models' and the plans' times: the host's pace taken out
        self._check_models(measured, norm[measured])
        # until a full window has decided, the plan in force is a guess (the probe's, the declared split,
        # or decided on first steps): the deadband does not hold it (a sample off held 50 steps at HL1)
        rough, self._rough = self._rough, not self._stepped[measured].all()
        self._hasty = bool(np.any(self._windows.lengths()[measured][~self._stepped[measured]] < self._first_window))
        self._stepped[measured] = True
        step_s = float(norm.max()) if len(measured) == len(self._active) else None
        if step_s is not None and not self._hasty:  # a worker's first step or two: its warm-up, not its plan's
            self.ran.record(batches, step_s)
        self._windows.clear()
        ranks = np.asarray(self._active if active is None else active, dtype=np.int64)
        # a worker above its bound (memory, membership, the probes' bound) moves whatever the deadband says
        over = bool(np.any(self._batches[ranks] > self._bounds[ranks]))
        free = over or reason in ("memory", "membership")
        band = 0.0 if free or rough else self.job.deadband
        lines = self.models.planning_lines(ranks, self._batches[ranks], self.job.global_batch)
        margin = noise_margins(self._windows.noise, ranks, lines[:, 1], changing)  # a noisy worker's, on its times
        lines = lines * margin[:, None]
        # a plan measured balanced over a whole window stays, whatever the lines say (they churned it at HL1)
        window_s = norm[ranks] * margin if step_s is not None and not changing else None
        sub = decide(self._batches[ranks], lines, self.job.global_batch, self.min_batch, self._bounds[ranks], band, window_s)
        rule = sub.rule or ("" if sub.batches is None else described(ranks, margin))
        pinned = self._unfounded_pins(ranks, sub, reason)
        if pinned.any():  # decided again, those workers at half their batch at least
            lo = np.full(len(ranks), self.min_batch, dtype=np.int64)
            lo[pinned] = np.minimum(np.ceil(SHRINK * self._batches[ranks][pinned]), self._bounds[ranks][pinned])
            sub = decide(self._batches[ranks], lines, self.job.global_batch, lo, self._bounds[ranks], band, window_s)
            rule = (f"worker(s) {ranks[pinned].tolist()} not put at the minimum batch on one window's "
                    "measurement: half their batch for now")
        cause, uniform = reason, self.bounds.uniform(ranks, lines)
        if self._persists(sub) and not self.ran.ran_slower(spread(sub.held, ranks, n), batches, MIN_GAIN):
            sub, reason = Decision(sub.held, sub.targets, sub.held_s), "held"
            rule = f"held back {PERSIST} windows running, predicted faster each time"
        even = None if free or pinned.any() else self._alike(sub, lines, ranks, cause, uniform)  # a guess's too
        if even is not None:
            sub, reason, rule = even, cause, even.rule
        targets = np.zeros(n)
        targets[ranks] = sub.targets
        decision = Decision(None if sub.batches is None else spread(sub.batches, ranks, n),
                            tuple(targets.tolist()), sub.predicted_s)
        if step_s is not None and not free:
            decision, reason, rule = self._regret(decision, reason, rule, ranks, step_s, uniform)
        if decision.batches is not None and decision.batches != batches:
            self.adjustments += reason not in ("membership", "probe")
            self.plan = BatchPlan(self.plan.gen + 1, decision.batches)
        else:
            self._expect()  # the models moved: so do the predictions
        shown = replace(decision, predicted_s=decision.predicted_s * self._pace)  # at the host's pace now
        return Adjustment(shown, tuple(times.tolist()), tuple(batches), reason, rule or "equal time")

    def _check_models(self, measured: np.ndarray, times: np.ndarray) -> None:
        """Feed a window to the models. A worker whose window agreed with its model's prediction is
        confirmed: its time rests on two measurements, not one. A worker whose time moved by more than
        CHANGE since its last window, at an unchanged batch or against its batch's move (regret.Seen),
        or whose window showed it (Windows.changed: a neighbour's hog), changed speed: what the plans measured
        before says nothing of the speeds now. (A worker whose time is not a line in the batch looks changed
        to its model at every move: only the plans' measured times keep the plan from going back and forth.)"""
        at = self.models.measured(measured)
        batches = self._batches[measured]
        agreed = np.zeros(len(measured), dtype=bool)
        if at.any():
            predicted = self.models.predict(measured[at], batches[at])
            agreed[at] = np.abs(times[at] - predicted) <= CHANGE * predicted
        if self._seen.changed(measured, batches, times) or self._changing:
            self.ran.clear()
        # a model from the probe alone that missed the first real step: its points, passes far smaller
        # than the batch, go (kept, they bent the slope: a plan a sample off the equal split held); so
        # does one that missed the window of a plan decided on first steps, which may have been a
        # warm-up's (under quotas a worker's second step at a new batch ran 1.4x its third)
        self.models.reset(measured[(~self._stepped[measured] | self._hasty) & ~agreed])
        self.models.observe(measured, batches, times, self._windows.noise.spreads(measured))
        self._confirmed[measured] = agreed

    def _unfounded_pins(self, ranks: np.ndarray, sub: Decision, reason: str) -> np.ndarray:
        """Which workers `sub` would put at the job's minimum batch from above twice that on one
        window's measurement, unconfirmed by their model (not at the start, nor when workers come or go)."""
        if sub.batches is None or reason in ("probe", "membership"):
            return np.zeros(len(ranks), dtype=bool)
        to = np.asarray(sub.batches)
        return ((to <= self.min_batch) & (SHRINK * self._batches[ranks] > self.min_batch)
                & ~self._confirmed[ranks])

    def _regret(self, decision: Decision, reason: str, rule: str, ranks: np.ndarray, step_s: float,
                uniform: tuple[int, ...] | None) -> tuple[Decision, str, str]:
        """Measured times outrank the models: the plan in force, measured REGRET slower than
        the best plan measured lately, goes back to that one; a plan measured that much slower
        than the best remembered is not taken again; and where the models are for staying, the
        uniform split may be better."""
        current = self.plan.batches

        def fits(plan):
            return bool(np.all(np.asarray(plan)[ranks] <= self._bounds[ranks]))

        back = self.ran.best(fits, BACK_WINDOWS)
        if back is not None and back[0] != current and step_s > back[1] * (1 + REGRET):
            return (Decision(back[0], decision.targets, back[1]), "regret",
                    f"measured {self._ms(step_s)}, more than {REGRET:.0%} slower than "
                    f"{list(back[0])} measured {self._ms(back[1])}: back to it")
        best = self.ran.best(fits)
        proposed = decision.batches
        if proposed is not None and best is not None and self.ran.worse(proposed, best[1]):
            return (Decision(None, decision.targets, step_s), "regret",
                    f"{list(proposed)} measured {self._ms(self.ran.step_s(proposed))}, more than "
                    f"{REGRET:.0%} slower than {list(best[0])}: not taken again for now")
        if proposed is None or proposed == current:
            return self._uniform_instead(decision, reason, rule, ranks, step_s, uniform)
        return decision, reason, rule

    def _uniform_instead(self, decision: Decision, reason: str, rule: str, ranks: np.ndarray, step_s: float,
                         uniform: tuple[int, ...] | None) -> tuple[Decision, str, str]:
        """The models for staying, but the plan in force measured REGRET slower than they predict
        the `uniform` split, not yet measured: they are wrong somewhere, so measure that split."""
        if (uniform is None or uniform == self.plan.batches or uniform in self.ran
                or not self.models.measured(ranks).all()):
            return decision, reason, rule
        uniform_s = float(np.max(self.models.predict(ranks, np.asarray(uniform)[ranks])))
        if step_s > uniform_s * (1 + REGRET):
            return (Decision(uniform, decision.targets, uniform_s), "regret",
                    f"measured {self._ms(step_s)}, more than {REGRET:.0%} slower than the uniform split "
                    f"predicted ({self._ms(uniform_s)}): the uniform split, to measure it")
        return decision, reason, rule

    def _alike(self, sub: Decision, lines: np.ndarray, ranks: np.ndarray, reason: str,
               uniform: tuple[int, ...] | None) -> Decision | None:
        """The `uniform` split (a decision for `ranks`) where the `lines` find the workers alike under
        it (batching.alike: within the deadband of the best plan's, at the probe its noise), unless it measured
        REGRET slower than the best in two windows (one window's time against another's is the host's
        noise as much: refusing it on 1-5 % put HL1's replays 0.2 % further off the uniform job):
        equal batches for workers the models cannot tell apart, where a plan a sample or two off,
        their noise, held in the deadband (under CPU quotas at HL1 [31, 31, 33, 33] held 32 steps)."""
        now, ran, even = self._batches[ranks], self.ran, None if uniform is None else np.asarray(uniform)[ranks]
        if even is None or np.array_equal(even, sub.batches if sub.batches is not None else now) or (
                uniform in ran and ran.worse(uniform, ran.best()[1])):
            return None  # (none, the decision already, or measured slower)
        band, what = ((max(self.job.deadband, PROBE_NOISE), "the probe's noise") if reason == "probe"
                      else (self.job.deadband, "the deadband"))
        even_s = alike(lines, even, sub.held_s if sub.held is not None else sub.predicted_s, band)
        return None if even_s is None else Decision(
            None if np.array_equal(even, now) else tuple(even.tolist()), sub.targets, even_s,
            rule=f"the uniform split, every worker predicted within {band:.0%} ({what}) of the best plan")

    def _ms(self, seconds: float) -> str:
        """A time of the models or the plans' memory, in words at the host's pace now."""
        return f"{1000 * self._pace * seconds:.1f} ms"

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

    def probed(self, points: dict[int, tuple[list, list]], memory: dict[int, int], spreads: dict | None = None,
               quotas: dict[int, float] | None = None) -> tuple[Adjustment, list[int]]:
        """The start plan from every worker's probe passes (rank -> their batch sizes and
        times): each worker's line through its probe points, within the batches its free
        memory holds (rank -> an estimate, as `estimate` takes), then a decision as after a
        window. Also the ranks whose memory estimate could not be applied. A worker whose
        passes of every size ran more than PROBE_NOISE apart (`spreads`, rank -> probe_times's)
        is taken at its mean throughput over them instead (passes a few samples apart, each a
        quota period off, make a line that extrapolates to anything); those under a CPU quota
        (`quotas`, rank -> cores, 0: none) share one shape of line (TimeModels.observe_probes)."""
        self.models.observe_probes(points, {rank for rank, s in (spreads or {}).items() if s > PROBE_NOISE},
                                   {rank for rank, q in (quotas or {}).items() if q > 0})
        refused = [rank for rank, bound in sorted(memory.items()) if not self.bounds.estimate(rank, bound, self._active)]
        return self.replan("probe"), refused

    def resize(self, active: list[int]) -> Adjustment:
        """Workers left or joined: re-plan for `active` at once. A worker new to its rank
        starts with a fresh time model (taken meanwhile to be as fast as the typical one)."""
        joined = [rank for rank in active if not self.plan.batches[rank]]
        self.models.reset(joined)
        self._stepped[joined] = False
        self._confirmed[joined] = False
        self._seen.forget(joined)
        for rank in joined:
            self._windows.forget(rank)
        self.ran.clear()  # the plans measured were another set of workers'
        return self.replan("membership", active)

    @property
    def max_batch(self) -> list[int]:
        return self._bounds.tolist()

    def limit(self, rank: int, max_batch: int) -> Adjustment | None:
        """A worker can hold at most `max_batch` samples in one pass (its --max-batch, or an
        out-of-memory step): lower its bound for good, and re-plan at once if its batch is
        now too large. ValueError when the workers together could no longer hold the global batch."""
        self.bounds.limit(rank, max_batch, self._active)
        return self._enforce(rank)

    def estimate(self, rank: int, max_batch: int) -> tuple[bool, Adjustment | None]:
        """A worker's free memory holds about `max_batch` samples: bound it there (up or down),
        re-planning at once if its batch is over. An estimate that would leave the workers unable
        to hold the global batch is not applied (False): the worker then finds its real limit by
        running out of memory, and computes in chunks."""
        applied = self.bounds.estimate(rank, max_batch, self._active)
        return applied, self._enforce(rank) if applied else None

    def _enforce(self, rank: int) -> Adjustment | None:
        return self.replan("memory") if self.plan.batches[rank] > self._bounds[rank] else None
