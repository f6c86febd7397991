"""The regret guard: the step times measured under recent plans, the plan to go back to, and
each worker's last window, which tells when those times are old news.

The controller's time models can be wrong the same way window after window (sustained
noise, a worker whose time is not a line in the batch, one slow step taken for a worker's
speed): then they propose, and hold, a plan slower than one the job has already run.
Measured step times outrank predictions: a plan measured REGRET slower than the best one
measured lately (BACK_WINDOWS) for the same workers is left at the next decision for that
one, and a plan measured that much slower in two windows (one can fall in a noise that
passes) is not taken again while it is remembered. A measurement is forgotten
FORGET_WINDOWS windows after it was taken (the noise that made a plan slow, or a good one
look good, passes), so that the models may try it again.

Pure logic: windows are counted by the caller (one `record` per full window).
"""

from dataclasses import dataclass

import numpy as np

from omnips.timemodel import CHANGE, MIN_SPREAD

REGRET = 0.10  # a plan this much slower than the best measured is measurably worse (a window's noise is a few %)
FORGET_WINDOWS = 24  # windows a measurement is kept (240 steps at --adjust-every 10)
# windows back a plan to go back to may have been measured: under a slow drift (a few % a window,
# below any window-to-window check) older times flatter the plans that ran then (simulated, 4096
# workers, 1 % a window: each window went back to one, and the plan settled 19 % off the oracle's)
BACK_WINDOWS = 4


@dataclass(frozen=True)
class Ran:
    step_s: float  # the slowest worker's median compute time over the window
    window: int  # the window it was measured in
    agreed: int = 1  # windows running, this one included, that measured it within REGRET of each other


class PlanMemory:
    """Step times of the plans run for one set of workers, newest measurement per plan."""

    def __init__(self):
        self._ran: dict[tuple[int, ...], Ran] = {}
        self.window = 0

    def record(self, plan: tuple[int, ...], step_s: float) -> None:
        """One full window run under `plan`; measurements FORGET_WINDOWS old are dropped, and
        all of them where `plan` ran CHANGE off its own last time: the speeds changed, and
        every plan's time is old news (under CPU quotas a neighbour's hog sent the plan back
        and forth between plans measured before it)."""
        self.window += 1
        old = self._ran.get(plan)
        if old is not None and not _within(old.step_s, step_s, CHANGE):
            self._ran.clear()
            old = None
        same = old is not None and _within(old.step_s, step_s, REGRET)
        self._ran[plan] = Ran(step_s, self.window, old.agreed + 1 if same else 1)
        for old in [p for p, r in self._ran.items() if self.window - r.window >= FORGET_WINDOWS]:
            del self._ran[old]

    def clear(self) -> None:
        """Another set of workers: what their plans measured says nothing of it."""
        self._ran.clear()

    def __contains__(self, plan) -> bool:
        return plan in self._ran

    def __len__(self) -> int:
        return len(self._ran)

    def step_s(self, plan: tuple[int, ...]) -> float | None:
        ran = self._ran.get(plan)
        return None if ran is None else ran.step_s

    def best(self, fits=lambda plan: True, within: int = FORGET_WINDOWS) -> tuple[tuple[int, ...], float] | None:
        """The fastest plan remembered among those `fits` accepts and measured in the last
        `within` windows, with its time."""
        for step_s, plan in sorted((r.step_s, plan) for plan, r in self._ran.items()
                                   if self.window - r.window < within):
            if fits(plan):
                return plan, step_s
        return None

    def worse(self, plan: tuple[int, ...], than_s: float) -> bool:
        """Whether `plan` measured more than REGRET slower than `than_s` in two windows that agreed."""
        ran = self._ran.get(plan)
        return ran is not None and ran.agreed >= 2 and ran.step_s > than_s * (1 + REGRET)

    def ran_slower(self, plan: tuple[int, ...], current: tuple[int, ...], margin: float) -> bool:
        """Whether `plan` ran and its slowest worker was not measured `margin` faster than
        under `current`: the models, wrong the same way every window, would otherwise propose
        it again and again, and it and the current plan would take turns for good."""
        a, b = self._ran.get(plan), self._ran.get(current)
        return a is not None and b is not None and a.step_s * (1 + margin) > b.step_s


def _within(x: float, y: float, by: float) -> bool:
    """Whether two times are at most a factor 1 + `by` apart."""
    return max(x, y) <= (1 + by) * min(x, y)


class Seen:
    """Each worker's last window median as measured (the time models rescale theirs) and its
    batch: what tells a change of speed, which makes every plan's measured time old news."""

    def __init__(self, n: int):
        self.batch = np.zeros(n)  # 0: none yet
        self.time = np.zeros(n)

    def forget(self, ranks) -> None:
        self.batch[ranks] = 0.0

    def changed(self, ranks, batches, seconds) -> bool:
        """Record a window of each of `ranks`; whether any changed speed by more than CHANGE:
        against its last window within MIN_SPREAD of its batch (scaled to it), or against its
        last window at all where its time moved the other way from its batch (no worker runs
        fewer samples more slowly: under CPU quotas a neighbour's hog doubled a worker's time
        as the plan cut its batch from 25 to 22, and the plan went back to one measured before
        the hog). Nothing else tells: across batches a worker need not be a line (a quota that
        runs out mid-step), and a model's prediction there rests on such a line."""
        b = np.asarray(batches, dtype=np.float64)
        t = np.asarray(seconds, dtype=np.float64)
        last_b, last_t = self.batch[ranks], self.time[ranks]
        seen = last_b > 0
        near = seen & (np.abs(b - last_b) <= MIN_SPREAD * last_b)
        expected = last_t * b / np.where(near, last_b, 1.0)
        slower, faster = t > (1 + CHANGE) * last_t, (1 + CHANGE) * t < last_t
        against = seen & (((b <= last_b) & slower) | ((b >= last_b) & faster))
        self.batch[ranks], self.time[ranks] = b, t
        return bool(np.any((near & (np.abs(t - expected) > CHANGE * expected)) | against))
