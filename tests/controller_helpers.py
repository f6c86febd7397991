"""What the controller's tests share: one worker's time model read plainly, the exact
equal-time plan, and a BatchControl driven a step or a window at a time."""

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
