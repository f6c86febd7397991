"""The batch plan's one owner in the scheduler: the plan every server and worker runs,
and, with dynamic batching, the controller that makes the next one from the starting
workers' probes, their step reports and their memory measurements. No sockets: it
records each plan in the run's events and returns the plans to send; the service sends
them. A plan the workers cannot run raises ValueError with the reason."""

import logging

import numpy as np

from omnips.batching import BatchPlan, memory_batch
from omnips.job import JobSpec
from omnips.protocol import Probe, Report

from .control import Adjustment, BatchControl
from .registry import Registry

log = logging.getLogger("omnips.scheduler")


class Planner:
    """The plan's one owner: its own until the cluster is complete; with dynamic batching
    from then on the controller's (which makes the next one), read through `plan` alike."""

    def __init__(self, job: JobSpec, registry: Registry, run):
        self.job, self.registry, self.run = job, registry, run  # run: the RunDir the events go to
        self.control: BatchControl | None = None  # dynamic batching, once the cluster is complete
        self._plan: BatchPlan | None = None  # static batching's plan (None before the start)
        self.probing: set[int] = set()  # ranks whose probe the start plan still waits for
        self._probes: dict[int, Probe] = {}  # rank -> its probe
        self._probe_memory: dict[int, int] = {}  # rank -> the batch its free memory holds, from its probe
        self._memory_warned: set[int] = set()  # ranks whose memory estimate could not be applied
        # rank -> the last step it reported (Progress keeps it too, per worker object: an array makes
        # the check for a step's last report one numpy operation at thousands of workers)
        self._reported = np.full(job.num_workers, -1)

    @property
    def plan(self) -> BatchPlan | None:
        """The plan every process runs (None before the cluster is complete)."""
        return self.control.plan if self.control is not None else self._plan

    def set(self, plan: BatchPlan) -> None:
        """`plan` is the one every process runs from now on."""
        if self.control is not None:
            self.control.plan = plan
        else:
            self._plan = plan

    @property
    def adjustments(self) -> int:
        return self.control.adjustments if self.control else 0

    def start(self, probe: bool) -> BatchPlan:
        """The cluster is complete: the first plan (the static split); with dynamic batching
        the controller starts from it, and with `probe` every worker's probe is waited for
        before the first step."""
        plan = BatchPlan(0, self.registry.static_batches(list(self.registry.workers)))
        if self.job.batching == "dynamic":
            self.control = BatchControl(self.job, plan)
            if probe:
                self.probing = set(self.registry.workers)
        else:
            self._plan = plan
        self.run.event("assign", gen=plan.gen, batches=list(plan.batches), step=0, reason="start")
        return plan

    def on_probe(self, msg: Probe) -> BatchPlan | None:
        """A starting worker's timed passes (the service checked it was awaited): the plan
        the first step runs once every probe is in, else None."""
        self.probing.discard(msg.rank)
        self._probes[msg.rank] = msg
        estimate = self._memory_estimate(msg.rank, msg.mem_free, msg.sample_bytes)
        if estimate is not None:
            self._probe_memory[msg.rank] = estimate
        self.run.event("probe", worker=msg.rank, batches=msg.batches, seconds=msg.seconds, spread=msg.spread,
                       quota=msg.quota)
        return None if self.probing else self._from_probes()

    def _from_probes(self) -> BatchPlan:
        """Every starting worker still in the job has probed: the plan from the probes (none
        when all that probed left: the plan stays)."""
        if self._probes:
            try:
                probes = self._probes.items()
                # a CPU quota paces CPU passes only: a GPU worker's passes keep their own line
                quotas = {rank: p.quota if self.registry.workers[rank].info.device == "cpu" else 0.0
                          for rank, p in probes}
                adjustment, refused = self.control.probed(
                    {rank: (p.batches, p.seconds) for rank, p in probes}, self._probe_memory,
                    {rank: p.spread for rank, p in probes}, quotas)
            except ValueError as exc:
                raise ValueError(f"dynamic batching failed on the probes: {exc}") from None
            for rank in refused:
                self._memory_not_applied(rank, self._probe_memory[rank])
            self._record(adjustment, 0, "start batches from the probes")
        return self.control.plan

    def on_report(self, r: Report, disturbed: bool) -> BatchPlan | None:
        """A worker's step report (`disturbed`: its step overlapped an evaluation or a
        checkpoint write, and is measured only where such steps are seen not to run slower:
        scheduler/disturbance.Effect): a new plan to send, or None inside the deadband."""
        control, before = self.control, self.control.plan
        self._reported[r.rank] = r.step
        harmless = control.disturbances.harmless
        # the worker's step time: compute and overhead (taking the batch, the push compute left, loading the pulled
        # parameters), not the servers' hold. A slow host is slow at both: under CPU quotas a thirtieth of a core's
        # worker spent 60-90 ms a step outside compute, a quarter of a core's 12 (benchmarks/results/cgroup.md)
        control.on_step(r.rank, r.batch, r.compute_s + r.overhead_s if r.compute_s > 0 else 0.0, disturbed)
        if control.disturbances.harmless != harmless:
            log.info("steps that overlap an evaluation or a checkpoint write are %s (the last %d ran %.2fx their "
                     "windows' times at the median)", "measured" if not harmless else "no longer measured",
                     control.disturbances.judged, control.disturbances.median)
        adjustment = None
        estimate = self._memory_estimate(r.rank, r.mem_free, r.sample_bytes)
        if r.mem_batch and r.mem_batch < control.bounds.hard[r.rank]:
            log.warning("worker %d can hold at most %d samples", r.rank, r.mem_batch)
            adjustment = control.limit(r.rank, r.mem_batch)
        elif estimate is not None and estimate != control.bounds.memory[r.rank]:
            applied, adjustment = control.estimate(r.rank, estimate)
            if not applied:
                self._memory_not_applied(r.rank, estimate)
        if adjustment is None and control.ready and self._step_in(r.step):
            try:
                adjustment = control.replan()
            except ValueError as exc:
                raise ValueError(f"dynamic batching failed: {exc}") from None
        if adjustment is None or control.plan == before:
            return None
        self._record(adjustment, r.step, "new batches", measured_batches=list(adjustment.batches),
                     step_s=list(adjustment.times),
                     throughput=[b / t if t > 0 else None for b, t in zip(adjustment.batches, adjustment.times)])
        return control.plan

    def _step_in(self, step: int) -> bool:
        """BSP: whether every worker in the plan has reported `step`. A decision waits for the
        step's last report, so that it sees every worker's latest step: a slowdown of the whole
        host shows in one worker's report of a step before another's. ASP and SSP workers are
        each at a step of their own: at once."""
        return self.job.mode != "bsp" or bool(self._reported[self.control.active].min() >= step)

    def membership(self, active: list[int], change: str, step: int) -> BatchPlan:
        """The plan for the workers `active` after a join or a departure (`change`) at `step`."""
        if self.control is None:
            plan = BatchPlan(self.plan.gen + 1, self.registry.static_batches(active))
            predicted = None
        else:
            try:
                predicted = self.control.resize(active).decision.predicted_s
            except ValueError as exc:
                raise ValueError(f"the workers left cannot hold the global batch: {exc}") from None
            plan = self.control.plan
        self.run.event("assign", gen=plan.gen, batches=list(plan.batches), reason=change, step=step,
                       predicted_step_s=predicted)
        return plan

    def departed(self, rank: int) -> BatchPlan | None:
        """Worker `rank` left: its probe says nothing of whoever takes its rank, and the
        others need not wait for it; the first step's plan when it was the last awaited."""
        self._probes.pop(rank, None)
        self._probe_memory.pop(rank, None)
        if rank not in self.probing:
            return None
        self.probing.discard(rank)
        return None if self.probing else self._from_probes()

    def _record(self, adjustment: Adjustment, step: int, what: str, **measured) -> None:
        """The plan the controller just made, into the run's events and the log."""
        plan, d = self.control.plan, adjustment.decision
        self.run.event("assign", gen=plan.gen, batches=list(plan.batches), reason=adjustment.reason,
                       rule=adjustment.rule, step=step, **measured, targets=list(d.targets),
                       predicted_step_s=d.predicted_s, max_batch=list(self.control.max_batch))
        log.info("%s %s (predicted step %.1f ms; %s)", what, list(plan.batches), 1000 * d.predicted_s, adjustment.rule)

    def _memory_estimate(self, rank: int, mem_free: int, sample_bytes: int) -> int | None:
        """The batch a worker's free memory holds (None: it did not measure)."""
        if not (mem_free and sample_bytes):
            return None
        return memory_batch(mem_free, sample_bytes, self.registry.sharing(rank),
                            self.registry.workers[rank].info.memory_limit)

    def _memory_not_applied(self, rank: int, estimate: int) -> None:
        if rank not in self._memory_warned:
            self._memory_warned.add(rank)
            log.warning("worker %d's free memory holds about %d samples, too few for the others to hold the "
                        "global batch: not applied (it will compute in chunks if it runs out)", rank, estimate)
