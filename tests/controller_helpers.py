"""What the controller's tests share: one worker's time model read plainly, the exact
equal-time plan, a BatchControl driven a step or a window at a time, and one held on a
plan its deadband holds back (held_back)."""

from hypothesis import Phase, settings

from omnips.batching import BatchPlan, equal_time, initial_batches, integerize
from omnips.job import JobSpec
from omnips.timemodel import TimeModels
from omnips.scheduler.control import BatchControl


class TimeModel:
    """One worker's time model (a TimeModels of one), with scalar arguments: what a test of
    one worker reads most plainly."""

    def __init__(self, affine: bool = True):
        self._models = TimeModels(1, affine)

    def observe(self, batch: int, seconds: float) -> None:
        self._models.observe([0], [batch], [seconds])

    def trusted_at(self, batch: int) -> bool:
        return bool(self._models.trusted_at([0], [batch])[0])

    def line(self) -> tuple[float, float]:
        """(a, c) of the current model; needs at least one observation."""
        a, c = self._models.lines([0])[0]
        return float(a), float(c)

    def predict(self, batch: int) -> float:
        return float(self._models.predict([0], [batch])[0])


DEADBAND = 0.05
# derandomized so that runs repeat; no shrinking phase (a failure is reported as found)
SEARCH = settings(max_examples=200, deadline=None, derandomize=True, database=None, phases=[Phase.generate])


def exact_plan(a, c, total):
    """The equal-time integer plan computed from the true lines."""
    lines = list(zip(a, c))
    return integerize(equal_time(lines, total, 1, total), total, 1, total, lines)


def off_by(batches, plan):
    return max(abs(x - y) for x, y in zip(batches, plan))


def control(num_workers=3, global_batch=60, adjust_every=4, capacities=None, **kw):
    job = JobSpec(batching="dynamic", num_workers=num_workers, global_batch=global_batch,
                  adjust_every=adjust_every, **kw)
    job.check()
    capacities = capacities or [1] * num_workers
    plan = BatchPlan(0, tuple(initial_batches("dynamic", global_batch, capacities, *job.batch_bounds)))
    return BatchControl(job, plan)


def step_all(ctl, seconds):
    """One step of every worker at its batch in the plan, taking `seconds(rank, batch)`."""
    for rank, b in enumerate(ctl.plan.batches):
        ctl.on_step(rank, b, seconds(rank, b))


def run_window(ctl, times, first=True):
    """Each worker reports adjust_every - 1 measured steps (plus the unmeasured first)."""
    for rank, t in enumerate(times):
        steps = ctl.job.adjust_every if first else ctl.job.adjust_every - 1
        for _ in range(steps):
            ctl.on_step(rank, ctl.plan.batches[rank], t)


def held_back(a, c, off, total=120):
    """A control whose models know the exact lines a + c*b (from probe passes and two windows
    on the probe's plan: past the first steps' decision), put on the plan `off` (as the
    scheduler hands one out), and a function running one window of exact times on the plan
    in force and deciding."""
    ctl = control(num_workers=len(a), global_batch=total)
    ctl.probed({r: ([2, 4], [a[r] + 2 * c[r], a[r] + 4 * c[r]]) for r in range(len(a))}, {})
    for k in range(2):
        run_window(ctl, [ai + ci * b for ai, ci, b in zip(a, c, ctl.plan.batches)], first=k == 0)
        start = ctl.plan
        ctl.replan()
        assert ctl.plan == start
    ctl.plan = BatchPlan(ctl.plan.gen + 1, off)

    ran = [None]

    def window():
        # a worker's first step at a batch size is not measured: one step more after a change
        run_window(ctl, [ai + ci * b for ai, ci, b in zip(a, c, ctl.plan.batches)], first=ctl.plan != ran[0])
        ran[0] = ctl.plan
        assert ctl.ready
        return ctl.replan()
    return ctl, window


# workers that take 40 ms for 56, 40 and 24 samples plus a fixed time: the best plan is not the
# uniform split (which the controller takes where it is predicted within the deadband of the best)
UNEVEN = [0.040 / 56, 0.040 / 40, 0.040 / 24]
BEST, OFF = (56, 40, 24), (57, 40, 23)
