"""Whether a job is training at all, from the losses its workers report (pure logic).

A job that does not learn still completes: its loss climbs to NaN or hovers where it
began (asynchronous updates with too much momentum: server/asynchrony.py). The watch
says so once, with the likely cause and the flag to try, and stops nothing (only
--nan-policy fail ends a job, on a non-finite gradient).

Diverged: a reported training loss or gradient that is not finite, or a mean training loss between
two evaluations that stays within MARGIN of the first epoch's mean (or above it) for
STUCK_EVALS evaluations running.
"""

import math
from dataclasses import dataclass

from omnips.job import JobSpec

MARGIN = 0.02  # a learning job's loss falls well below its first epoch's mean by its third
STUCK_EVALS = 2


@dataclass(frozen=True)
class Diverged:
    reason: str
    hint: str


class LossWatch:
    def __init__(self, job: JobSpec):
        self.job = job
        self.first: float | None = None  # sample-weighted mean loss of the first epoch
        self._sum = self._samples = 0.0  # since the last evaluation (or in the first epoch)
        self._stuck = 0
        self.verdict: Diverged | None = None

    def on_loss(self, loss: float, batch: int, epoch: float, worker: int, step: int,
                finite_gradient: bool = True) -> Diverged | None:
        """A worker's training loss over `batch` samples, reported at `epoch` of the job;
        the verdict the first time it is reached."""
        if self.verdict is not None:
            return None
        if not math.isfinite(loss) or not finite_gradient:
            what = "training loss" if not math.isfinite(loss) else f"gradient (loss {loss:.4g})"
            return self._decide(f"worker {worker}'s {what} at step {step} is not finite")
        if self.first is None and epoch >= 1 and self._samples:
            self.first = self._sum / self._samples
            self._sum = self._samples = 0.0
        self._sum += loss * batch
        self._samples += batch
        return None

    def on_eval(self) -> Diverged | None:
        """An evaluation: the loss since the last one is judged (once the first epoch is known)."""
        if self.verdict is not None or self.first is None or not self._samples:
            return None
        recent = self._sum / self._samples
        self._sum = self._samples = 0.0
        self._stuck = self._stuck + 1 if recent >= self.first * (1 - MARGIN) else 0
        if self._stuck < STUCK_EVALS:
            return None
        return self._decide(f"the training loss ({recent:.4g}) has not fallen below its first epoch's "
                            f"({self.first:.4g}) for {STUCK_EVALS} evaluations")

    def _decide(self, reason: str) -> Diverged:
        self.verdict = Diverged(reason, self._hint())
        return self.verdict

    def _hint(self) -> str:
        job = self.job
        if job.mode != "bsp" and job.async_correction == "none":
            return ("asynchronous updates add momentum of their own: try --async-correction momentum "
                    "(the default), or a lower --momentum")
        if job.mode != "bsp" and job.async_correction != "momentum":
            return "try --async-correction momentum (the default), or a lower --lr"
        return f"try a lower --lr (now {job.lr:g})" + (f" or --momentum (now {job.momentum:g})"
                                                        if job.optimizer == "sgd" and job.momentum else "")
