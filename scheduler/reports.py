"""A worker's step reports and probes, and the checkpoints they make due: part of the
scheduler's pure core (scheduler/core.py). A report is admitted (a registered worker, the
step it is due to report, a batch the job allows) before it counts; then it may ask for an
evaluation, a checkpoint, a new plan or the end of an ASP job's sample budget. A probe,
from a worker before its first step, may complete the start plan. BSP checkpoints are
asked in advance, at exact versions, like its evaluations; the end of the job waits for
them within the servers' timeout (120 s)."""

import logging

from omnips.batching import BatchPlan
from omnips.protocol import Checkpoint, Probe, Report, Saved

from .divergence import Diverged, Recovered
from .instructions import AskCheckpoint, JobFailed, WriteStep
from .progress import whole_step_s

log = logging.getLogger("omnips.scheduler")

CHECKPOINTS_AHEAD = 32  # BSP checkpoint requests kept waiting at the servers


class Reports:
    def __init__(self, core):
        self.core = core  # the SchedulerCore this is part of
        self.nonfinite = 0  # gradients with NaN or inf the workers reported
        self.checkpoint_steps = range(0)  # BSP: those not asked yet

    def on_report(self, peer: bytes, r: Report) -> None:
        core = self.core
        if not core.registry.complete:
            core.refuse(peer, "not_started", "the job has not started")
            return
        member = core.registry.by_peer.get(peer)
        if member is None or member.role != "worker" or member.rank != r.rank:
            core.refuse(peer, "bad_rank", "report from an unregistered peer or the wrong rank")
            return
        if not core.progress.expects(r):
            if core.progress.stale(r):  # not an error: it crossed the rewind on its way here
                log.info("worker %d's report for step %d was sent before the rewind: dropped", r.rank, r.step)
            else:
                core.refuse(peer, "bad_step", f"report for step {r.step}, expected {core.progress.next_step(r.rank)}")
            return
        top = core.job.batch_bounds[1]
        if r.batch > top:  # it would count samples no step took (an ASP job's budget)
            core.refuse(peer, "bad_batch", f"report of a batch of {r.batch}, the job's largest is {top}")
            return
        if not r.done:
            self.diverged(core.losses.on_loss(r.loss, r.batch, r.rank, r.step, finite_gradient=not r.nonfinite))
        if r.nonfinite:
            self._nonfinite(r)
        for point in core.progress.on_report(r, core.now):
            core.evals.ask(point, final=False)
        core.stalls.on_report(r.rank, r.step, core.now)
        if r.done:
            core.stalls.leave(r.rank)
            log.info("worker %d finished after %d steps", r.rank, r.step)
            core.evals.final_if_done()
            return
        disturbed = core.disturbances.touches(core.now, whole_step_s(r))
        core.out.append(WriteStep(r, core.progress.epochs, disturbed))
        if core.job.mode != "bsp" and not core.planner.plan.stop:
            updates = sum(w.steps for w in core.progress.workers)
            if core.checkpoints.due(updates):
                self.ask_checkpoint(updates, None)
        if core.job.mode != "bsp" and core.progress.budget_reached and not core.planner.plan.stop:
            plan = core.planner.plan
            core.send_plan(BatchPlan(plan.gen + 1, plan.batches, stop=True))
            log.info("sample budget reached: asking workers to stop")
        elif core.planner.control is not None and not core.planner.plan.stop:
            plan = core.planned(core.planner.on_report, r, disturbed)
            if plan is not None:
                core.send_plan(plan)

    def _nonfinite(self, r: Report) -> None:
        core = self.core
        self.nonfinite += 1
        core.out.event("nonfinite", worker=r.rank, step=r.step, loss=r.loss, policy=core.job.nan_policy)
        if core.job.nan_policy == "fail":
            raise JobFailed(f"worker {r.rank}'s gradient at step {r.step} has NaN or inf values "
                            f"(loss {r.loss:g}); --nan-policy skip would drop such gradients instead"
                            + ("; float16 on the wire turns |values| >= 65520 into inf"
                               if core.job.wire_dtype == "float16" else ""))
        log.warning("worker %d's gradient at step %d has NaN or inf values: dropped", r.rank, r.step)

    def on_probe(self, peer: bytes, msg: Probe) -> None:
        """A worker's timed passes before its first step: once every starting worker's are in,
        the first step's plan, sent to the servers and to each worker (which waits for it)."""
        core = self.core
        member = core.registry.by_peer.get(peer)
        if member is None or member.role != "worker" or member.rank != msg.rank:
            core.refuse(peer, "bad_rank", "probe from an unregistered peer or the wrong rank")
            return
        if msg.rank not in core.planner.probing:
            core.refuse(peer, "bad_step", f"no probe expected from worker {msg.rank}: the job is past its start")
            return
        plan = core.planned(core.planner.on_probe, msg)
        core.progress.on_probe(sum(msg.seconds), core.now)
        core.start_plan(plan)

    def bsp_checkpoints(self, total_steps: int) -> None:
        """The servers' sockets are (re)opened: the BSP checkpoints from here on, asked in advance."""
        self.checkpoint_steps = self.core.checkpoints.bsp_steps(total_steps)
        self.ask_bsp_checkpoints()

    def ask_bsp_checkpoints(self) -> None:
        """Keep CHECKPOINTS_AHEAD requests waiting at the servers: one asked after its version
        passed is missed, and the driver can be busy evaluating for a while."""
        core = self.core
        while self.checkpoint_steps and len(core.checkpoints.pending) < CHECKPOINTS_AHEAD:
            step, self.checkpoint_steps = self.checkpoint_steps[0], self.checkpoint_steps[1:]
            self.ask_checkpoint(step, step)

    def ask_checkpoint(self, step: int, at: int | None) -> int:
        """The request's number (checkpoint_unsent says if it did not reach the servers)."""
        core = self.core
        request = core.checkpoints.open(step, *core.progress.restart_point(at))
        core.out.append(AskCheckpoint(Checkpoint(request=request, step=step, at=at)))
        return request

    def on_saved(self, s: int, msg: Saved) -> None:
        core = self.core
        core.disturbances.add(core.now - msg.write_s, core.now)
        outcome = core.checkpoints.add(s, msg)
        if outcome is None:
            return
        step, failure = outcome
        core.out.event("checkpoint", step=step, complete=failure is None, error=failure)
        if core.stop is not None:
            core.stop.on_checkpoint(msg.request, step, failure)
        if failure is None:
            log.info("checkpoint %d complete", step)
        else:
            log.warning("checkpoint %d is incomplete: %s", step, failure)
        if core.job.mode == "bsp":
            self.ask_bsp_checkpoints()

    def end_overdue(self) -> None:
        """The servers' timeout (120 s) passed since every worker was done: without the final
        evaluation the job fails; with it (the model is whole) a checkpoint still unanswered is
        given up."""
        core = self.core
        limit = core.alive.server_timeout_s
        if core.evals.final is None:
            raise JobFailed(f"servers did not answer the final evaluation pull within {limit:g} s")
        for step in core.checkpoints.abandon():
            why = f"servers did not answer within {limit:g} s of the job's end"
            log.warning("checkpoint %d is incomplete: %s (the final model is whole)", step, why)
            core.out.event("checkpoint", step=step, complete=False, error=why)

    def diverged(self, verdict: Diverged | Recovered | None) -> None:
        if isinstance(verdict, Recovered):
            log.info("training recovered: %s", verdict.reason)
            self.core.out.event("recovered", reason=verdict.reason)
        elif verdict is not None:
            log.warning("training diverged: %s; %s", verdict.reason, verdict.hint)
            self.core.out.event("diverged", reason=verdict.reason, hint=verdict.hint)
