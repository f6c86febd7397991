"""Evaluations: when the model is read from the servers, the shard replies gathered per
request until it is whole, what an evaluation's result writes, and the final one whose
model is model.pt. Pure: it appends what to do to the core's Outbox (AskEval, Evaluate,
WriteEvent); the driver pulls, evaluates and writes the file.

BSP reads exact versions known in advance (EVALS_AHEAD pulls kept waiting at the
servers, the last step's final); ASP/SSP read the model as the servers hold it when the
samples cross an epoch, and for the final one once every worker present has stopped.
The final version reaches the scheduler as the workers' last reports do, or before them: it
is evaluated once every worker present has stopped, so that the job's time ends with its
last step and not behind an evaluation that kept the reports waiting (on loaded hosts
1-2 s, 2 % of a job of 100 steps)."""

import logging
from dataclasses import dataclass, field

from omnips.job import JobSpec
from omnips.protocol import Params

from .instructions import AskEval, Evaluate, Outbox
from .progress import EvalPoint, Progress

log = logging.getLogger("omnips.scheduler")

EVALS_AHEAD = 32


@dataclass
class PendingEval:
    point: EvalPoint
    final: bool
    shards: dict[int, Params] = field(default_factory=dict)  # server rank -> reply (keeps its frame alive)


class EvalBook:
    def __init__(self, num_servers: int):
        self.num_servers = num_servers
        self.pending: dict[int, PendingEval] = {}
        self._next_request = 0
        self.final_asked = False

    def open(self, point: EvalPoint, final: bool) -> int:
        self._next_request += 1
        self.final_asked |= final
        self.pending[self._next_request] = PendingEval(point, final)
        return self._next_request

    def add(self, server: int, msg: Params) -> PendingEval | None:
        """Record one shard; returns the evaluation once every shard is in."""
        entry = self.pending.get(msg.request)
        if entry is None:
            return None
        entry.shards[server] = msg
        if len(entry.shards) < self.num_servers:
            return None
        return self.pending.pop(msg.request)


class Evaluations:
    def __init__(self, job: JobSpec, progress: Progress, out: Outbox):
        self.job, self.progress, self.out = job, progress, out
        self.book = EvalBook(job.num_servers)
        self.final: tuple[float, float] | None = None  # the final evaluation's (accuracy, loss)
        self._bsp_points: list[EvalPoint] = []
        self._held: PendingEval | None = None  # BSP's final version, in before the workers stopped

    def connected(self) -> None:
        """The servers' sockets are (re)opened: what was asked on the old ones will not come;
        BSP asks its evaluations in advance."""
        self.book = EvalBook(self.job.num_servers)
        self._held = None
        if self.job.mode == "bsp":
            self._bsp_points = list(self.progress.bsp_eval_points())
            self._ask_ahead()

    def _ask_ahead(self) -> None:
        """Keep EVALS_AHEAD evaluation pulls waiting at the servers (each a queued message there)."""
        while self._bsp_points and len(self.book.pending) < EVALS_AHEAD:
            point = self._bsp_points.pop(0)
            self.ask(point, final=point.at == self.progress.total_steps)

    def ask(self, point: EvalPoint, final: bool) -> None:
        self.out.append(AskEval(self.book.open(point, final), point.at))

    def final_if_done(self) -> None:
        """Once every worker present has stopped, by its last report or by leaving the job (found
        silent after the others had finished): ASP/SSP read the model as the servers hold it; BSP,
        which asked for its final version in advance, evaluates it if it is in."""
        if not self.progress.all_done:
            return
        if self._held is not None:
            self.out.append(Evaluate(self._held))
            self._held = None
        elif self.job.mode != "bsp" and not self.book.final_asked:
            self.ask(EvalPoint(self.progress.samples / self.progress.train_size, None), final=True)

    def final_now(self) -> None:
        """A stop: the model as the servers hold it where the workers stopped (ASP/SSP: unless
        asked already, as the last worker stopped)."""
        if self.job.mode == "bsp" or not self.book.final_asked:
            self.ask(EvalPoint(self.progress.epochs, None), final=True)

    def on_params(self, server: int, msg: Params) -> None:
        done = self.book.add(server, msg)
        if done is None:
            return
        if done.final and done.point.at is not None and not self.progress.all_done:
            self._held = done  # BSP's last step: see final_if_done (a stop's final reads the model now)
        else:
            self.out.append(Evaluate(done))

    def evaluated(self, e: PendingEval, acc: float, loss: float) -> None:
        versions = [e.shards[s].version for s in sorted(e.shards)]
        self.out.event("eval", epoch=e.point.epoch, versions=versions, test_accuracy=acc, test_loss=loss,
                       final=e.final)
        log.info("epoch %.2f: test accuracy %.4f, loss %.4f", e.point.epoch, acc, loss)
        if e.final:
            self.final = (acc, loss)
        self._ask_ahead()
