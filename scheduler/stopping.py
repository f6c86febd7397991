"""A preemption (SIGTERM or SIGUSR1 to the scheduler, SIGTERM to a server): the workers stop
after their step in flight, as at the end of the sample budget; once all have, the servers
are read for model.pt and asked for a checkpoint to resume from, at the version where the
workers stopped. All within STOP_WAIT_S (a supervisor's SIGKILL follows its SIGTERM), then
the job ends as preempted (omnips.job.PREEMPTED_EXIT), saying what it saved."""

import logging
import math
from dataclasses import dataclass

from omnips.batching import BatchPlan

log = logging.getLogger("omnips.scheduler")

STOP_WAIT_S = 20.0


@dataclass
class Stop:
    why: str  # what asked for it, e.g. "SIGTERM", "SIGTERM to server 1 on node3"
    start: float
    wait_s: float  # 0: nothing to save (no step was trained)
    saving: bool = False  # the model (and checkpoint) were asked of the servers
    checkpoint_request: int | None = None  # the checkpoint request waited for; None: none (asked)
    checkpoint: str = ""  # what became of it, once answered

    @property
    def deadline(self) -> float:
        return self.start + self.wait_s

    def save_now(self, all_stopped: bool, now: float) -> bool:
        """Whether to read the model (and ask for the checkpoint) now: once every worker has
        stopped, or half-way to the deadline without them: one alive but slow, or every
        one silent (one silent beside others heard is lost sooner: worker_silence_limit)."""
        if not self.waiting or now > self.deadline:
            return False
        return all_stopped or now >= self.start + self.wait_s / 2

    @property
    def waiting(self) -> bool:
        """It waits for the workers to stop: something was trained, and the model not yet asked."""
        return bool(self.wait_s) and not self.saving

    @property
    def saved(self) -> bool:
        """Every answer is in: the model, and the checkpoint if one was asked."""
        return self.saving and (self.checkpoint_request is None or bool(self.checkpoint))

    def on_checkpoint(self, request: int, step: int, failure: str | None) -> None:
        if request == self.checkpoint_request:
            self.checkpoint = f"checkpoint {step} complete" if failure is None else f"checkpoint {step} failed: {failure}"

    def detail(self, steps: int, model: bool) -> str:
        """What the preemption saved, as summary.json's `preempted` says it."""
        what = ["model.pt written" if model else "model.pt not written"]
        if self.checkpoint_request is not None:
            what.append(self.checkpoint or "the checkpoint was not answered")
        elif self.saving:
            what.append("no checkpoint (the servers could not be asked)")
        return f"{self.why} at step {steps}: " + ", ".join(what)


def worker_silence_limit(core) -> float:
    """How long a worker may be silent before it is taken for lost: --dead-after, or a few
    seconds while a stop waits for the workers and another is still heard (--dead-after is
    longer than the stop may wait). A BSP worker frozen part-way through its push holds its
    step on the shards it had not reached, while the others applied it: lost, it is waited
    for no more, the others end the step on every shard, and the model is read at one
    version. With every worker silent none could end it: none is lost, and the model is
    read half-way to the deadline (save_now), at one version only if none froze mid-push."""
    dead_after, stop = core.opts.dead_after_s, core.stop
    if stop is None or not stop.waiting:
        return dead_after
    short = min(dead_after, max(3 * core.opts.heartbeat_s, stop.wait_s / 4))
    heard = min((core.alive.silent(m.peer, core.now) for m in core.registry.workers.values()), default=math.inf)
    return short if heard <= short else dead_after


def on_leave(role: str, stopping: bool, others_present: int) -> str:
    """What a process's SIGTERM (its `leave`) does to the job:
    "preempt": a server (its shard cannot leave), or the last worker (a job without workers
      cannot go on; a batch system that signals every process at once must not see it fail);
    "stopped": a worker while a preemption is under way: it stopped after its step, as asked;
    "depart": any other worker: the job re-plans without it."""
    if role == "server" or others_present == 0:
        return "preempt"
    return "stopped" if stopping else "depart"


def begin_or_save(core) -> None:
    """A stop was asked (request_stop): the workers stop after their step in flight (the
    plan that ends an ASP job), then the model and a checkpoint are asked of the servers
    (Stop.save_now). A job that has not trained yet ends at once."""
    if core.stop is None:
        trained = core.progress.last_end is not None
        core.stop = Stop(core.stop_asked, core.now, STOP_WAIT_S if trained else 0.0)
        core.stop_asked = None
        if trained:
            log.warning("%s: preempted: the workers stop after their step in flight, then model.pt and a "
                        "checkpoint are written (within %g s)", core.stop.why, STOP_WAIT_S)
            plan = core.planner.plan
            if not plan.stop:
                core.send_plan(BatchPlan(plan.gen + 1, plan.batches, stop=True))
    if core.stop.save_now(core.progress.all_done, core.now):
        core.stop.saving = True
        core.evals.final_now()
        steps = core.progress.steps  # BSP: at the version where every worker stopped
        core.stop.checkpoint_request = core.reports.ask_checkpoint(steps, steps if core.job.mode == "bsp" else None)
