"""Whether a job is training at all, from the losses its workers report (pure logic).

A job that does not learn still completes: its loss climbs to NaN or hovers where it
began (asynchronous updates with too much momentum: server/asynchrony.py). The watch
says so once, with the likely cause and the flag to try, and stops nothing (only
--nan-policy fail ends a job, on a non-finite gradient).

Diverged: a reported training loss that is not finite; a gradient that is not finite
where --nan-policy fail ends the job for it, or NONFINITE_RUN of them running under
--nan-policy skip (which drops the odd one by design); or, in a job started afresh, a
mean training loss between two evaluations that stays within MARGIN of its mark (or
above it) for STUCK_EVALS evaluations running. The mark is the lowest of the first
epoch's mean, the mean of the first reports (the untrained model's loss: a first epoch
that blew up and settled at chance level would hide a job that learns nothing) and
chance level (the loss of predicting the label frequencies: an untrained model a little
above it would otherwise put a job sitting at chance level within MARGIN of below it).
A resumed job's loss may rightly stay where the checkpoint left it: only the
non-finite rules apply to it. A job called stuck that learns after all (a model that
sits at chance level for its first epochs, then learns) is said to have recovered once
its loss between two evaluations falls RECOVERED below its mark: the verdict is
withdrawn. A non-finite loss or gradient is never withdrawn.
"""

import math
from dataclasses import dataclass

from omnips.job import JobSpec

MARGIN = 0.02  # a learning job's loss falls well below its first epoch's mean by its third
STUCK_EVALS = 2
RECOVERED = 0.10  # a stuck job whose loss falls this far below its start learns after all
NONFINITE_RUN = 10  # reports running, under --nan-policy skip


@dataclass(frozen=True)
class Diverged:
    reason: str
    hint: str


@dataclass(frozen=True)
class Recovered:
    """A stuck verdict withdrawn: the job learns after all."""

    reason: str


class LossWatch:
    def __init__(self, job: JobSpec, train_size: int, resumed: bool = False, chance: float = math.inf):
        """`chance`: the loss of predicting the label frequencies (models.chance_loss)."""
        self.job, self.train_size, self.resumed, self.chance = job, train_size, resumed, chance
        self.first: float | None = None  # the start: see the module's docstring
        self._opening: list[float] = []  # the first reports' losses, one per starting worker
        self._sum = self._samples = 0.0  # since the last evaluation (or in the first epoch)
        self._stuck = 0
        self._nonfinite = 0  # gradients that were not finite, reports running
        self.verdict: Diverged | None = None
        self._stuck_verdict = False  # the verdict is the stuck rule's: the loss is still watched

    def on_loss(self, loss: float, batch: int, worker: int, step: int, finite_gradient: bool = True) -> Diverged | None:
        """A worker's training loss over `batch` samples; the verdict the first time it is reached."""
        if self.verdict is not None and not self._stuck_verdict:
            return None
        if not math.isfinite(loss):
            return self._decide(f"worker {worker}'s training loss at step {step} is not finite ({loss})")
        if not finite_gradient:
            self._nonfinite += 1
            if self.job.nan_policy == "fail" or self._nonfinite >= NONFINITE_RUN:
                return self._decide(f"worker {worker}'s gradient at step {step} is not finite (loss {loss:.4g})"
                                    + (f", the {NONFINITE_RUN}th report running" if self._nonfinite > 1 else ""))
            return None
        self._nonfinite = 0
        if len(self._opening) < self.job.start_workers:
            self._opening.append(loss)
        if self.first is None and self._samples >= self.train_size:
            self.first = min(self._sum / self._samples, sum(self._opening) / len(self._opening))
            self._sum = self._samples = 0.0
        self._sum += loss * batch
        self._samples += batch
        return None

    def on_eval(self) -> Diverged | Recovered | None:
        """An evaluation: the loss since the last one is judged (once the first epoch is known)."""
        if self.resumed or self.first is None or not self._samples:
            return None
        recent = self._sum / self._samples
        self._sum = self._samples = 0.0
        mark, said = ((self.first, f"its start ({self.first:.4g})") if self.first <= self.chance
                      else (self.chance, f"chance level ({self.chance:.4g}, the label frequencies' loss)"))
        if self.verdict is not None:
            if not (self._stuck_verdict and recent < mark * (1 - RECOVERED)):
                return None
            self.verdict, self._stuck_verdict, self._stuck = None, False, 0
            return Recovered(f"the training loss ({recent:.4g}) is now below {said}: the job learns after all")
        self._stuck = self._stuck + 1 if recent >= mark * (1 - MARGIN) else 0
        if self._stuck < STUCK_EVALS:
            return None
        verdict = self._decide(f"the training loss ({recent:.4g}) has not fallen below {said} "
                               f"for {STUCK_EVALS} evaluations")
        self._stuck_verdict = True
        return verdict

    def _decide(self, reason: str) -> Diverged:
        self._stuck_verdict = False
        self.verdict = Diverged(reason, self._hint())
        return self.verdict

    def _hint(self) -> str:
        job, default = self.job, JobSpec.async_correction
        if job.mode != "bsp" and job.async_correction == "none":
            return (f"asynchronous updates add momentum of their own: try --async-correction {default} "
                    "(the default), or a lower --momentum")
        if job.mode != "bsp" and job.async_correction != default:
            return f"try --async-correction {default} (the default), or a lower --lr"
        return f"try a lower --lr (now {job.lr:g})" + (f" or --momentum (now {job.momentum:g})"
                                                        if job.optimizer == "sgd" and job.momentum else "")
