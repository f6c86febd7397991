"""Each worker's window of measured step times at its batch in the plan, and what counts as
far off it: an outlier, unless CHANGE_STEPS in a row to one side (one more below SMALL_CHANGE,
one alone past a factor FAR: change_steps) say its speed changed (then the window restarts
from them: a median across a change would be a time it never had, and a fit through it a wrong
slope). A worker's first step at a new batch
size is not measured (it pays for warming up).

A fixed tolerance does not fit every machine. Under a CPU quota a step's time depends on
how much of the period's quota is left when it starts: a worker's steps at one batch took
23 to 70 ms, its neighbour's 111 to 171 ms, with no change of speed at all. At 20 % most of
those steps were outliers or, three to one side, a "change" that restarted the window, so
no window ever filled and the controller never decided again: a plan with one worker 3x
slower than the others held for 55 steps. A worker's tolerance is therefore the larger of
CHANGE and SPREAD_K robust standard deviations (1.4826 x the median absolute deviation) of
the logarithms of its last RECENT reports, outliers included: times are off by factors (half
the time is as far off as twice it; a tolerance of 54 % read as a difference hid a worker's
steps at half their time, a neighbour's hog gone, for a whole window). A far-off step joins the
spread only once the next step shows it an outlier: counted at once, a change's first step
widened the tolerance that judged the second (a neighbour's hog gone, a worker's second step
at 0.47x its window fell inside it, and the change waited 10 steps for a full window).

Pure: no clock, no I/O.
"""

import math
import statistics
from collections import deque

import numpy as np

from omnips.timemodel import CHANGE, off_by, off_by_far

from .disturbance import Effect

# consecutive far-off steps that are a change of speed (fewer are outliers) and re-plan early: far
# off is beyond the worker's own noise, so two in a row by chance are rare, and each step waited
# for is one more on the old plan (a neighbour's CPU hog made a worker's steps 2.5x slower)
CHANGE_STEPS = 2
# a far-off step off by a factor FAR (omnips/timemodel.py: no line's error) is a change at once: each step
# waited for holds the whole job 2x or more (a neighbour's CPU hog: steps of 2.0, 1.6 and 2.0 s where the
# others took 0.7 while two steps confirmed the change and the plan reached the workers, at 0.34-0.50 of
# the ideal). One-off steps that far are rare: 4 of 22,293 measured steps of the cgroup runs ran 2x their
# last ones but for a change of speed, all beside other jobs
FAR_STEPS = 1
# far-off steps nearer their window than this factor are a change one step later: under CPU quotas beside
# other jobs a worker's steps ran 1.3-1.45x its window two steps running and then as before (in 4 of 8
# runs, each time re-planning samples off it for a window), while a neighbour's hog or a quota halved made
# 2x; a step more of a small change costs a fraction of a step, a window of a plan chasing noise several
SMALL_CHANGE = 1.5
# steps in a row off by a factor FAR, to one side, that are a change where the worker's tolerance is
# wider still: under a neighbour's CPU hog a worker's steps at 5 samples took 0.40 to 1.28 s (a
# tolerance of 3.2x), the hog's end made them 0.28-0.33 s, and the plan held 11 steps with that
# worker idle three quarters of each step. Such steps are rare by noise alone: under the hog, in 12
# neighbour runs, 2 of a worker's 336 steps ran 2x off the median of its steps at their batch
WIDE_STEPS = 3

# the host's pace: a window whose times all part the same way from the models' predictions, by
# PACE_MOVE on PACE_SHARE of the workers (PACE_WORKERS at least), ran on a slower or faster host
PACE_MOVE = 0.1
PACE_SHARE = 0.75
PACE_WORKERS = 3

# measured steps at a new batch that cannot begin a change of speed: they may still warm up (under
# CPU quotas, after a worker's batch grew, its first measured step took 1.2x its later steps or more
# in 19 % of 194 moves, its third in 6 %), and they are what checks the model at that batch. Read
# as a change, two steps 1.3x the prediction, the first of them such, moved the plan 12 samples off
# a worker for the 16 steps its next window took
SETTLE = 1

# a worker's first CHANGE_STEPS measured steps at a batch off its model's guess by this factor, to one
# side, re-plan before the first window is full (scheduler/control.py's FIRST_WINDOW): under CPU quotas,
# of 600 workers' first steps 13 % ran more than 20 % off the median of their next steps at the same
# batch, 2.7 % more than 1.35x, 0.3 % more than 1.5x. At 20 % one of four workers' noise re-planned at
# once in about 43 % of jobs, and the windows after chased that plan. One step alone is not enough: at
# a job's start beside other jobs' starts, one worker's or two workers' second step ran 1.45-1.54x its
# next ones, and, read as misses, re-planned 6-9 samples off for 6-15 steps (benchmarks/cgroup.py, HL1
# and HL4)
FIRST_MISS = 1.5
# and its first FIRST_STEPS all slower by FIRST_DRIFT: a model wrong by less, which a full window would
# otherwise wait out. Under a neighbour's CPU hog a worker re-planned from 23 samples to 14 ran its first
# steps there 1.57, 1.35 and 1.65x its guess (the second under FIRST_MISS), and its plan held 10 steps
# more at 1.3 s where the others took 0.8. Three first steps that far by noise alone are rare: 2.7 % of
# the 600 first steps above ran 1.35x off. Slower only: a worker slower than planned holds every step,
# one faster idles alone; and replayed on recorded steps (benchmarks/replay.py), a re-plan on three fast
# steps and the others' partial windows cut a fast worker's batch and cost one neighbour replay 12 %
FIRST_DRIFT = 1.3
FIRST_STEPS = 3

RECENT = 16  # reports kept per worker
MIN_REPORTS = 5  # fewer say nothing of the spread: the last estimate (or none) stands
SPREAD_K = 3.0  # robust standard deviations off the window that make a step far off
MAD_SIGMA = 1.4826  # the median absolute deviation of a normal distribution, in standard deviations


def log_spread(times) -> float:
    """A robust standard deviation of the logarithms of `times` (> 0): a spread by factors."""
    logs = [math.log(t) for t in times]
    med = statistics.median(logs)
    return MAD_SIGMA * statistics.median(abs(x - med) for x in logs)


def change_steps(far_off, expected: float) -> int:
    """How many far-off steps in a row to one side make a change of speed, from those so far
    (`far_off`, the latest last): FAR_STEPS where the latest is off `expected` past FAR, else
    CHANGE_STEPS, one more where their median is off by less than SMALL_CHANGE."""
    if off_by_far(far_off[-1], expected):
        return FAR_STEPS
    return CHANGE_STEPS + (not off_by(statistics.median(far_off), expected, SMALL_CHANGE))


def first_miss(firsts, guess: float) -> bool:
    """Whether a worker's first measured steps at a batch (FIRST_STEPS at most) missed its model's
    `guess`: the first CHANGE_STEPS each by FIRST_MISS to one side, or the first FIRST_STEPS each
    slower by FIRST_DRIFT (nan: misses nothing)."""
    def beyond(steps, factor: float) -> bool:
        return all(t > factor * guess for t in steps) or all(factor * t < guess for t in steps)

    return ((len(firsts) >= CHANGE_STEPS and beyond(firsts[:CHANGE_STEPS], FIRST_MISS))
            or (len(firsts) >= FIRST_STEPS and all(t > FIRST_DRIFT * guess for t in firsts[:FIRST_STEPS])))


def host_pace(ratios: np.ndarray) -> float:
    """How much slower the host ran a window than the models predicted, from the workers'
    measured over predicted times (those whose models are trusted at their batch): their
    median where they moved together, else 1. A slowdown of the whole host (on a shared
    machine, of every job's processes) scales every worker's time alike and leaves the
    equal-time plan as it is. Read as the workers' own change it tilted the plan: under CPU
    quotas four equal workers' times went 1.20, 1.31, 1.27 and 1.24 times their models', the
    three past CHANGE had their models rescaled, the one just under it averaged with its
    past, and the plan gave it 37 samples of 128. A median over fewer
    than PACE_WORKERS, or over workers that did not all move, would take one worker's own
    change for the host's (two of four slowed by 1.3x: each half then moved by 13 %, under
    CHANGE, and the plan followed neither)."""
    if len(ratios) < PACE_WORKERS:
        return 1.0
    moved = max(np.count_nonzero(ratios > 1 + PACE_MOVE), np.count_nonzero(ratios < 1 / (1 + PACE_MOVE)))
    return float(np.median(ratios)) if moved >= PACE_SHARE * len(ratios) else 1.0


def _since_change(suspects: list[float], typical: float, tolerance: float) -> list[float]:
    """Of the far-off steps that show a change of speed, those at the new speed. A change begins
    within a step, which runs partly at each speed. Where the furthest step is off `typical` past
    FAR (a change by itself), the steps before it further than the worker's `tolerance` from it
    are left out: a neighbour's CPU hog made steps of 1.56 and 2.49 s after 0.83, a window of both
    rescaled the worker's model by 2.4 where the hog's steps ran 3x, and the plan held 12 steps with
    it the slowest by 30 %; the hog gone, 0.52, 0.43 and 0.24 s after 0.75 gave it 17 samples, and
    its steps then ran 0.75x the others'. Nearer changes are told from noise by fewer steps: the
    first is left out only where it is off by less than half as much as each of the next, as
    factors (under a CPU quota halved, a worker's steps went 1.41, 1.71, 2.70, 2.90 s, and a window
    of 1.71 and 2.70 rescaled its model by 1.56 where its speed had moved by 2)."""
    far = [abs(math.log(t / typical)) for t in suspects]
    top = far.index(max(far))
    if off_by_far(suspects[top], typical):
        return [t for i, t in enumerate(suspects) if i >= top or not off_by(t, suspects[top], 1 + tolerance)]
    return suspects[1:] if len(far) > 1 and 2 * far[0] < min(far[1:]) else list(suspects)


class StepNoise:
    """Kept cheap per report (a report costs O(1) at thousands of workers): the spread is
    computed only when a step is further off than CHANGE, where the tolerance matters, and
    when the worker moves to another batch; the time models take the last estimate
    (`spreads`) for the span a slope needs (omnips/timemodel.SLOPE_K)."""

    def __init__(self, n: int):
        self._recent = [deque(maxlen=RECENT) for _ in range(n)]
        self._spread = [0.0] * n  # the last estimate, kept through a move: a noisy machine stays noisy

    def add(self, rank: int, *seconds: float) -> None:
        self._recent[rank].extend(seconds)

    def restart(self, rank: int, times=()) -> None:
        """The worker moved to another batch, or changed speed: its reports from before no
        longer measure its spread (a change would inflate it); `times` are its first since."""
        self._estimate(rank)
        self._recent[rank].clear()
        self._recent[rank].extend(times)

    def forget(self, rank: int) -> None:
        """A worker new to its rank: nothing is known of its machine."""
        self._recent[rank].clear()
        self._spread[rank] = 0.0

    def far(self, rank: int, seconds: float, typical: float, new: bool = False) -> bool:
        """Whether `seconds` is further off `typical` than the worker's tolerance (its spread
        computed only past CHANGE, where it matters, with `seconds` among its reports where it is
        a `new` one, not kept yet), as a factor either way; a nan `typical` is near everything."""
        if not abs(seconds - typical) > CHANGE * typical:
            return False
        return off_by(seconds, typical, 1 + self.tolerance(rank, (seconds,) if new else ()))

    def spreads(self, ranks) -> np.ndarray:
        """The last spread estimated of each of `ranks` (0: none yet), without estimating anew."""
        return np.asarray(self._spread)[ranks]

    def current(self, rank: int) -> float:
        """The worker's spread over its reports since its last move or change of speed alone (0:
        fewer than MIN_REPORTS), which the margin of a noisy worker takes (scheduler/margins.py):
        unlike `spreads`, no estimate from before them (a neighbour's hog gone, its spread stayed)."""
        reports = self._recent[rank]
        return log_spread(reports) if len(reports) >= MIN_REPORTS else 0.0

    def tolerance(self, rank: int, also=()) -> float:
        """How far, relative, a step may be off the worker's window (either way, as a factor:
        1 + tolerance) and still belong to it; `also`: reports counted as if kept."""
        return max(CHANGE, math.expm1(SPREAD_K * self._estimate(rank, also)))

    def _estimate(self, rank: int, also=()) -> float:
        reports = [*self._recent[rank], *also][-RECENT:] if also else self._recent[rank]
        if len(reports) >= MIN_REPORTS:
            self._spread[rank] = log_spread(reports)
        return self._spread[rank]


class Windows:
    """Every worker's window: its steps at its batch in the plan since the last decision."""

    def __init__(self, n: int):
        self._steps = [[] for _ in range(n)]
        self._suspects = [[] for _ in range(n)]  # far-off steps in a row, to one side: outliers, or a change
        self._restarted = np.zeros(n, dtype=bool)  # the window restarted at a change of speed: it holds the change
        self.noise = StepNoise(n)
        self.disturbances = Effect()  # whether steps that overlapped an evaluation or a checkpoint write ran slower
        self.median = np.zeros(n)  # of each window
        self._current = np.zeros(n, dtype=bool)  # the median was measured at the worker's batch now
        self._batch: list[int | None] = [None] * n  # the batch each worker is measured at
        self._at_batch = np.zeros(n, dtype=np.int64)  # measured steps at it, outliers included
        self._latest = np.full(n, np.nan)  # each worker's latest measured step at it
        self._firsts = [[] for _ in range(n)]  # its first FIRST_STEPS measured steps at it, outliers included

    def __getitem__(self, rank: int) -> list[float]:
        return self._steps[rank]

    def share_change(self, changing: set[int], predicted: np.ndarray, measured: np.ndarray,
                     times: np.ndarray) -> None:
        """The workers `changing` changed speed (their models predicted `predicted`): another whose
        latest steps are off its window the same way, fewer than make a change, changed too, and
        its time in `times` is theirs. A slowdown of the whole host crosses one worker's tolerance
        a step before another's (1.19 s, then 1.48, after 1.10 under a CPU quota), whose window
        from before made it look 30 % faster."""
        ranks = sorted(changing)
        slower = np.mean(self.median[ranks] > predicted[ranks]) >= 0.5
        for rank in measured.tolist():
            pending = self._suspects[rank]
            if pending and rank not in changing and (pending[-1] > self.median[rank]) == slower:
                times[rank] = statistics.median(pending)

    def changed(self, rank: int, predicted: np.ndarray, guess: float = math.nan) -> bool:
        """Whether the worker's last change_steps steps are all far off its model's time at its batch
        (`predicted`: every worker's, nan where untrusted), none of them among its first SETTLE there,
        as measured and at the host's pace over every worker's latest step: a change of its speed,
        not of the host's (under CPU quotas, beside other jobs,
        a worker's two steps 1.3x its model's while the others' ran 1.2x re-planned on partial
        windows, as did a worker's 0.71x while the others' ran 0.74-0.84x). Where the model is not
        trusted, steps off its `guess` by a factor FAR are a change too, as the model takes them,
        with no host's pace to judge by (a neighbour's CPU hog gone, a worker's steps ran 0.45x its guess
        between two sizes measured under the hog, and waited a full window). Its last WIDE_STEPS
        steps, off its model's time by a factor FAR to one side, are a change whatever its tolerance.
        A window that `add` restarted at a change of speed counted the change's steps already, against
        the worker's own steps: its steps since are enough, all far off as above. Counted again against
        the model, one change was judged twice: a neighbour's hog made a step 2.02x its window (a change
        at once) but 1.98x its model (two steps), the next two, at full hog, ran 1.3x that partial step
        (three, as a small change), and the re-plan waited three steps of 3 s where the others took 1.2."""
        steps, expected = self._steps[rank], predicted[rank]
        need = change_steps(steps[-CHANGE_STEPS:], expected) if steps and np.isfinite(expected) else CHANGE_STEPS
        if self._restarted[rank]:
            need = min(need, len(steps))
        if not np.isfinite(expected):
            last = steps[-need:]
            return self._settled(rank, last, need) and all(off_by_far(t, guess) for t in last)
        pace = self._pace(predicted)

        def off(last, far) -> bool:  # as measured, and at the host's pace
            return all(far(t, expected) and (pace == 1.0 or far(t, pace * expected)) for t in last)

        last, wide = steps[-need:], steps[-WIDE_STEPS:]
        return ((self._settled(rank, last, need) and off(last, lambda t, e: self.noise.far(rank, t, e)))
                or (self._settled(rank, wide, WIDE_STEPS) and len({t > expected for t in wide}) == 1
                    and off(wide, off_by_far)))

    def _settled(self, rank: int, last: list[float], need: int) -> bool:
        """Whether `last` holds `need` steps, none among the worker's first SETTLE at its batch."""
        return len(last) == need and self._at_batch[rank] >= SETTLE + need

    def firsts(self, rank: int) -> list[float]:
        return self._firsts[rank]

    def misses(self, ranks: set[int], guess: np.ndarray) -> set[int]:
        """Of `ranks`, whose first steps missed its `guess` (first_miss), those that miss it at the
        host's pace too, over every worker's latest step: a slower host is no miss."""
        pace = self._pace(guess)
        return {r for r in ranks if first_miss(self._firsts[r], pace * guess[r])}

    def _pace(self, expected: np.ndarray) -> float:
        """The host's pace over every worker's latest step against its `expected` time (nan: none)."""
        known = np.isfinite(expected) & np.isfinite(self._latest)
        return host_pace(self._latest[known] / expected[known])

    def lengths(self) -> np.ndarray:
        return np.fromiter(map(len, self._steps), dtype=np.int64, count=len(self._steps))

    def clear(self, rank: int | None = None) -> None:
        for steps in self._steps if rank is None else [self._steps[rank]]:
            steps.clear()  # in place: 4096 new lists cost more (the collector runs) than clearing
        self._restarted[slice(None) if rank is None else rank] = False

    def forget(self, rank: int) -> None:
        """A worker new to its rank."""
        self._batch[rank] = None
        self._restarted[rank] = False
        self._latest[rank] = np.nan
        self._current[rank] = False
        self._firsts[rank].clear()
        self.noise.forget(rank)

    def add(self, rank: int, batch: int, seconds: float, disturbed: bool = False,
            predicted: float = math.nan) -> bool:
        """A step of `rank` at `batch` (its batch in the plan); False when it changed nothing
        (an outlier, so far, or a `disturbed` step while disturbances are not known harmless:
        disturbance.Effect judges them by such steps measured against their windows). `predicted`:
        its model's trusted time at `batch` (nan: none), which judges its first steps there."""
        steps, suspects = self._steps[rank], self._suspects[rank]
        if disturbed:
            if self._batch[rank] == batch and steps:
                self.disturbances.note(seconds / self.median[rank])
            if not self.disturbances.harmless:
                return False
        if self._batch[rank] != batch:
            self._batch[rank] = batch  # first step at this size: warm-up, not measured
            self._at_batch[rank] = 0
            self._latest[rank] = np.nan
            self._current[rank] = False
            self._restarted[rank] = False
            self._firsts[rank].clear()
            steps.clear()
            suspects.clear()
            self.noise.restart(rank)
            return True
        # the worker's own recent history: its window, or where it is empty the last one at this batch (a
        # decision that left the batch; under CPU quotas at HL1 a window's first step at 1.4x, taken as it
        # was, and one more later made a median 1.4x, and the plan moved 8 samples for 12 steps); at a new
        # batch, its model's prediction: a first step taken as it was (under HL8 quotas, 1.6x the prediction
        # and the worker's steps before and after) judged the next ones, a step at the prediction was an
        # outlier against it, and a window of it and a 1.4x step moved 5 of the worker's 14 samples off it
        # for 4 steps. A prediction that the steps miss, they show as a change a step or two later
        typical = self.median[rank] if self._current[rank] else predicted
        self._at_batch[rank] += 1
        self._latest[rank] = seconds
        if len(self._firsts[rank]) < FIRST_STEPS:
            self._firsts[rank].append(seconds)
        far = self.noise.far(rank, seconds, typical, new=True)  # kept later if an outlier: see the docstring
        if far or off_by_far(seconds, typical):
            if suspects and (suspects[-1] > typical) != (seconds > typical):
                self.noise.add(rank, *suspects)  # outliers, then
                suspects.clear()
            suspects.append(seconds)
            if len(suspects) < (change_steps(suspects, typical) if far else WIDE_STEPS):
                return False  # an outlier, unless the next steps say the same
            steps[:] = _since_change(suspects, typical, self.noise.tolerance(rank))
            self._restarted[rank] = True
            self.noise.restart(rank, steps)
            suspects.clear()
        else:
            self.noise.add(rank, *suspects, seconds)  # (the suspects were outliers)
            suspects.clear()
            steps.append(seconds)
        self.median[rank] = statistics.median(steps)
        self._current[rank] = True
        return True
