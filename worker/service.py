"""The worker process, the driver of its core (worker/core.py): register, then compute, push and
pull as the core says until the job ends."""

import logging
import os
import socket as pysocket
import time

import torch
import zmq

from omnips import data, fingerprint, models, routes
from omnips.batching import BACKWARD_FACTOR, PROBE_BATCHES, PROBE_ROUNDS, BatchPlan, probe_times, probe_too_flat
from omnips.flat import FlatModel
from omnips.leaving import Leaving
from omnips.link import LinkError, SchedulerLink
from omnips.protocol import MAX_REASON, Failed, Leave, Probe, Register, Report, Rewind
from omnips.servers import ServerError, ServerGroup
from omnips.wire import WireDtype

from . import memory, threads
from .buckets import bucket_values
from .core import REWIND_PHASE, Exit, Finish, GoBack, Join, Limits, Listen, SendProbe, Step, WorkerCore
from .options import WorkerOptions
from .pushing import Pusher
from .quota import cpu_quota, paced as quota_paced, pacing as quota_pacing
from .trainer import Trainer, resolve_device

log = logging.getLogger("omnips.worker")

HOLD_BEATS = 2  # heartbeat intervals of the scheduler's silence after which no step starts


def run(opts: WorkerOptions, leaving: Leaving | None = None) -> int:
    kept = memory.keep_freed_memory()
    if not kept:
        log.info("the C allocator is not glibc's: memory a step frees goes back to the system as the allocator "
                 "decides (steps with large tensors may pay to map it again each time)")
    device = resolve_device(opts.device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    ctx = zmq.Context()
    link = None
    core = WorkerCore(pysocket.gethostname(), Limits(start_plan_s=opts.welcome_timeout_s,
                                                     rewind_s=opts.server_timeout_s, close_s=opts.server_timeout_s))
    try:
        link = SchedulerLink(ctx, opts.scheduler, keys=opts.keys)
        welcome = link.register(
            Register(role="worker", host=core.host, capacity=opts.capacity, device=str(device),
                     threads=opts.threads, pid=os.getpid(), rank=opts.rank,  # 0: chosen at the welcome
                     memory_limit=opts.memory_limit, token=opts.token),
            opts.ack_timeout_s, opts.welcome_timeout_s)
        job, cluster = welcome.job, welcome.cluster
        if not opts.threads:
            _choose_threads(welcome.rank, welcome.worker.host_workers)
        link.dead_after_s, link.heartbeat_s = cluster.dead_after_s, cluster.heartbeat_s
        try:
            session = _Session(job, welcome.rank, cluster, welcome.worker, device, opts, link, core,
                               warm=kept and device.type == "cpu")
            session.leaving = leaving or Leaving()
            # on_wait twice per heartbeat interval: what a waiting worker's heartbeats say is that fresh
            session.connect = lambda servers, local: ServerGroup(
                ctx, routes.endpoints(servers, local, opts.transport), cluster.ranges, opts.server_timeout_s,
                on_wait=session.on_wait, on_refusal=session.on_refusal, tick_s=min(1.0, link.heartbeat_s / 2),
                keys=opts.keys, wire=session.wire)
            session.servers = session.connect(cluster.servers, cluster.ipc)
            return session.train()
        except LinkError:  # about the scheduler (silent, or it ended us): nothing to tell it
            raise
        except Exception as exc:
            # our last word: the scheduler re-plans at once instead of waiting out --dead-after
            # (the linger below gives it time to leave)
            said, who = " ".join(str(exc).split()), f"worker {welcome.rank} on {core.host}: "
            reason = said if said.startswith(who) else who + said
            link.send(Failed(reason=reason[:MAX_REASON]))
            raise
    finally:
        if link is not None:
            link.close()  # the thread sends what is left (a Failed) before the context ends
        ctx.destroy(linger=1000)


def _choose_threads(rank: int, here: int) -> None:
    """An equal share of this host's cores among the job's `here` workers on it (worker/threads.py)."""
    cores = threads.usable_cores()
    torch.set_num_threads(threads.share(cores, here))
    log.info("worker %d: %d torch thread(s): %d core(s) shared by %d worker(s) of this job on this host "
             "(--threads N to choose)", rank, torch.get_num_threads(), cores, here)


def _check_fingerprints(theirs: dict | None, model: str, dataset: str) -> None:
    """The scheduler's digests of the model and data set (omnips.fingerprint) against ours: the
    same code must run everywhere; a scheduler that sends none is not checked against."""
    if theirs is None:
        return
    for what, ours in (("data set", dataset), ("model", model)):
        key = "data" if what == "data set" else "model"
        if theirs.get(key) != ours:
            raise ValueError(f"this worker's {what} differs from the scheduler's (digest {ours}, the scheduler's "
                             f"{str(theirs.get(key))[:16]}): the {what}'s code or files differ between machines "
                             "(module types, parameter names, shapes and dtypes, or samples)")


class _Session:
    """The driver of a WorkerCore: it does what the core says next and tells it what happened."""

    def __init__(self, job, rank, cluster, start, device, opts, link, core: WorkerCore, warm: bool = False):
        self.job, self.rank, self.opts, self.link, self.core = job, rank, opts, link, core
        self.servers: ServerGroup | None = None
        self.connect = None  # (tcp endpoints, [host, ipc endpoint] pairs) -> a ServerGroup on them
        # join_gen -1: there from the start; resumed: servers restored a checkpoint, go on from its
        # step and sample position
        self.join_gen, self.resumed = start.join_gen, start.resumed
        plan = start.plan
        self.step: int | None = None  # the step in flight, for our heartbeats
        # our heartbeats name each phase, however long it takes on a loaded host
        with link.in_phase("loading the data set"):
            train, test = data.load(job.dataset, job.dataset_args)
        with link.in_phase("building the model"):
            self.flat = FlatModel(models.build(job.model, job.model_args, train, job.seed), device)
        if self.flat.size != cluster.num_params:
            raise ValueError(f"this worker's model has {self.flat.size} values, the scheduler's "
                             f"{cluster.num_params}: the model or its code differs between machines")
        _check_fingerprints(start.fingerprints, fingerprint.model(self.flat.module),
                            fingerprint.data(train, test))
        self.wire = WireDtype(job.wire_dtype)
        batcher = data.Batcher(train)
        self.trainer = Trainer(self.flat, batcher, opts.max_batch, opts.fault_oom_above)
        # before the first pull, which overwrites whatever the probe touched (and before the
        # pusher's hooks exist)
        with link.in_phase("measuring memory"):
            self.sample_bytes = memory.sample_bytes(self.flat.module, batcher, range(len(train)), device)
        self.warm, self.warmed = warm, 0  # the largest batch the heap was warmed for (memory.warm_heap)
        # dynamic batching plans the first step from every worker's timed passes (a joiner
        # and a resumed job go on with the plan they are given)
        probes = job.batching == "dynamic" and job.probe and self.join_gen < 0 and not self.resumed
        core.welcomed(rank, job.num_workers, job.mode == "bsp", start.total_steps, plan, start.step,
                      start.position, probes)
        live = device.type == "cpu" and not opts.emulation.active
        self.pusher = Pusher(self.flat, cluster.ranges, bucket_values(opts.bucket_bytes), live, self.wire)
        self.trainer.on_final_pass, self.trainer.on_retry = self.pusher.final_pass, self.pusher.settle
        # ASP: a stream per worker; one that joins later draws a stream of its own, not its rank's old one
        incarnation = 0 if self.join_gen < 0 else 1 + self.join_gen
        self.stream = data.SampleStream(len(train), job.seed,
                                        stream=0 if core.bsp else 1 + rank + job.num_workers * incarnation)
        log.info("worker %d on %s: %s, %d values, batch %d", rank, device, job.mode, self.flat.size,
                 plan.batches[rank])

    def train(self) -> int:
        """Do what the core says until the scheduler closes the job (0), this worker leaves it
        (a SIGTERM: 0, after the step in flight) or something fails (an exception)."""
        last: Report | None = None
        while True:
            self.hear()
            act = self.core.next(time.monotonic())
            if isinstance(act, Step):
                if self._scheduler_quiet(act.step):
                    continue  # held until it was heard: what it said may change the step
                last = self._step(act) or last
                if self.leaving.due():  # the scheduler re-plans the others at once, as for a lost worker
                    self.link.send(Leave(why=self.leaving.why))
                    log.warning("worker %d on %s: %s: leaving the job after step %d", self.rank, self.core.host,
                                self.leaving.why, act.step)
                    return 0
            elif isinstance(act, Listen):
                self.link.sock.poll(1000 * min(1.0, self.link.heartbeat_s))
            elif isinstance(act, Join):
                self._join()
            elif isinstance(act, SendProbe):
                self._send_probe()
            elif isinstance(act, GoBack):
                self._rewind(act.rewind)
            elif isinstance(act, Finish):
                self.link.send(Report(rank=self.rank, step=act.step, batch=0, compute_s=0.0, network_s=0.0,
                                      wait_s=0.0, loss=last.loss if last else 0.0, done=True))
            elif isinstance(act, Exit):
                log.info("worker %d: the scheduler closed the job", self.rank)
                return 0
            else:
                raise (LinkError if act.cause == "scheduler" else ServerError)(act.reason)

    def _join(self) -> None:
        """The servers' values, to start from (worker 0 of a new job gives them theirs first)."""
        if self.join_gen < 0:
            if self.rank == 0 and not self.resumed and self.servers.init(self.flat.params) is None:
                return
            ex = self.servers.pull(self.flat.params)
        else:  # joining: BSP waits for the first step that runs the plan with this worker in it
            ex = self.servers.pull(self.flat.params, gen=self.join_gen)
        if ex is None:
            return  # interrupted: the core knows why
        self.flat.load_params()
        step = ex.versions[0] if self.join_gen >= 0 and self.core.bsp else self.core.step
        if self.join_gen >= 0:
            log.info("worker %d joins at step %d", self.rank, step)
        self.core.joined(step, self._plan(ex.plan), time.monotonic())

    def _send_probe(self) -> None:
        """Once the model is in place: the job's time counts from the probe."""
        sizes, quota = list(PROBE_BATCHES), cpu_quota()
        pace = quota_pacing(self.flat.device.type, quota)
        if quota is not None:
            log.info("worker %d: under a CPU quota of %.3g cores: probe passes on %s are timed %s", self.rank, quota,
                     self.flat.device, "at its pace" if pace else "as they run")
        with self.link.in_phase("probing its speed"):
            seconds, spread = self._probe(sizes, pace)
        self.link.send(Probe(rank=self.rank, batches=sizes, seconds=seconds, spread=spread, quota=quota or 0.0,
                             mem_free=memory.free_bytes(self.flat.device), sample_bytes=self.sample_bytes))
        self.core.probed(time.monotonic())

    def _paced(self, size: int, quota: float | None) -> float:
        """One probe pass of `size` samples, at the pace of passes back to back (worker/quota.py)."""
        cpu = time.process_time()
        wall = self.trainer.compute(list(range(size)))[1]
        return quota_paced(wall, time.process_time() - cpu, quota)

    def _probe(self, sizes: list[int], quota: float | None) -> tuple[list[float], float]:
        """Seconds of one forward and backward pass over the first `size` samples, for each
        of `sizes`, as this worker's (emulated) device takes them (under a CPU `quota`, at its
        pace: worker/quota.py), and their spread: the fastest of
        PROBE_ROUNDS passes, taken in turn, since on a busy host noise only adds time (one
        slow pass of a few samples moved a whole start plan), and more while they disagree or
        the larger is too fast for a line (omnips/batching.probe_times). Nothing is pushed (the
        pusher is unhooked), the model's buffers (normalisation statistics the passes move)
        and the random state are left as the pull set them, and the gradient the passes
        leave is zeroed by the first step."""
        devices = [self.flat.device] if self.flat.device.type == "cuda" else []
        buffers = self.flat.params[self.flat.num_trained:].copy()
        hooks = self.trainer.on_final_pass, self.trainer.on_retry
        self.trainer.on_final_pass = self.trainer.on_retry = None
        try:
            with torch.random.fork_rng(devices=devices):
                seconds, rounds, spread = probe_times(lambda size: self._pad(0, size, self._paced(size, quota)), sizes)
            if rounds > PROBE_ROUNDS:
                log.info("worker %d: probe passes of %s samples took %s s in %d rounds%s", self.rank, sizes,
                         [round(t, 4) for t in seconds], rounds,
                         " and the larger is still too fast for a line (a busy host?)"
                         if probe_too_flat(seconds) else "")
            return seconds, spread
        finally:
            self.trainer.on_final_pass, self.trainer.on_retry = hooks
            self.flat.params[self.flat.num_trained:] = buffers
            self.flat.load_params()

    def _rewind(self, msg: Rewind) -> None:
        """Abandon the step in flight, connect to the servers as they are now, and pull the
        model of the checkpoint."""
        log.info("worker %d: a server was lost, the job goes back to step %d", self.rank, msg.steps[self.rank])
        self.step = None
        self.servers.close()
        self.servers = self.connect(msg.servers, msg.ipc)
        if self.servers.pull(self.flat.params) is None:  # BSP: the version stays the checkpoint's until all push
            return  # interrupted: the core knows why
        self.flat.load_params()
        self.core.rewound(time.monotonic())

    def _step(self, act: Step) -> Report | None:
        """One step: compute, push and pull, report; None when a scheduler's message or a
        server's refusal interrupted it (the core knows which)."""
        step, batch = act.step, act.batch
        began = time.monotonic()
        if self.warm and batch > self.warmed:  # (in the step's time: the first at a batch is not measured)
            # for the samples added: what the heap holds free already is not written again
            warmed = memory.warm_heap(int(BACKWARD_FACTOR * self.sample_bytes * (batch - self.warmed)))
            log.info("worker %d: heap warmed for batch %d (%.1f MiB in %.2f s)", self.rank, batch, warmed / 2**20,
                     time.monotonic() - began)
            self.warmed = batch
        self.step = step
        self.link.state = {"phase": "computing", "step": step}
        if self.core.bsp:
            start = data.bsp_slice_start(step * self.job.global_batch, self.core.plan.batches, self.rank)
        else:
            start = act.position
        before = list(self.servers.versions)
        self.pusher.begin(self.servers, self.rank, step, batch, self.core.plan.gen)
        loss, real_s = self.trainer.compute(self.stream.take(start, batch), poison=step in self.opts.fault_nan_at)
        if self.servers.interrupted:  # (waits for the servers in the forward pass ended early)
            self.step = None
            return None
        compute_s = self._pad(step, batch, real_s)
        finite = self.pusher.finish()
        if not finite:
            self._nonfinite(step, batch, loss)
            self.pusher.drop()
        ex = self.servers.collect(step, self.flat.params, early=self.pusher.live)
        self.step = None
        if ex is None:
            return None
        self.flat.load_params()
        self.core.stepped(batch, self._plan(ex.plan))
        staleness = max(0, max(v - 1 - b for v, b in zip(ex.versions, before)))
        last = Report(rank=self.rank, step=step, batch=batch, compute_s=compute_s,
                      network_s=max(0.0, ex.elapsed_s - ex.held_s), wait_s=ex.held_s, loss=loss,
                      staleness=staleness, mem_batch=self.trainer.max_batch,
                      mem_free=memory.free_bytes(self.flat.device),
                      sample_bytes=self.sample_bytes, nonfinite=not finite,
                      overhead_s=max(0.0, time.monotonic() - began - compute_s - ex.held_s))
        self.link.send(last)
        return last

    def _nonfinite(self, step: int, batch: int, loss: float) -> None:
        """--nan-policy skip: log it (the push then carries no gradient); fail: tell the
        scheduler, which ends the job, and stop."""
        as_wire = "" if self.wire.exact else f" as {self.wire.name}"
        what = f"worker {self.rank}'s gradient at step {step} has NaN or inf values{as_wire} (loss {loss:g})"
        if self.job.nan_policy == "skip":
            log.warning("%s: dropped (--nan-policy skip)", what)
            return
        self.link.send(Report(rank=self.rank, step=step, batch=batch, compute_s=0.0, network_s=0.0, wait_s=0.0,
                              loss=loss, nonfinite=True))
        raise ValueError(f"{what}: the job ends (--nan-policy fail)")

    def _pad(self, step: int, batch: int, real_s: float) -> float:
        target = self.opts.emulation.target_s(step, batch, real_s)
        if target > real_s:
            time.sleep(target - real_s)  # the emulated slower device: the delay is the feature
        return max(target, real_s)

    def _plan(self, plan: BatchPlan | None) -> BatchPlan | None:
        """The plan a server's reply carried, if any (ValueError: one of another size)."""
        return None if plan is None else plan.sized(self.job.num_workers)

    def _scheduler_quiet(self, step: int) -> bool:
        """A scheduler silent for HOLD_BEATS heartbeat intervals may be dead: a step taken now
        is work nobody records (its report, a checkpoint no manifest completes). Wait until it
        is heard again (a pause: True, and the step goes on) or --dead-after passes (check_alive
        gives up); False when it is heard."""
        if self.link.quiet_s() <= HOLD_BEATS * self.link.heartbeat_s:
            return False
        log.info("worker %d: no word from the scheduler for %.1f s: step %d waits until it is heard", self.rank,
                 self.link.quiet_s(), step)
        while self.link.quiet_s() > HOLD_BEATS * self.link.heartbeat_s:
            self.link.sock.poll(int(1000 * self.link.heartbeat_s) + 1)
            self.hear()
        log.info("worker %d: the scheduler is heard again: step %d goes on", self.rank, step)
        return True

    def hear(self) -> None:
        """Hand the core what the scheduler sent, and the time; LinkError when the scheduler
        failed the job or went silent. Our heartbeats (sent from the link's thread) say what
        we do: a step that waits for the servers, for how long and for which of them."""
        waiting = self.servers.waiting() if self.servers is not None and self.step is not None else None
        if waiting is not None:
            self.link.state = {"phase": "waiting for servers", "step": self.step, "waited_s": waiting[0],
                               "servers": waiting[1]}
        elif self.core.awaiting_rewind():
            self.link.state = {"phase": REWIND_PHASE}
        else:
            self.link.state = {"phase": "training"} if self.step is not None else {}
        while self.link.sock.poll(0):
            msg = self.link.receive()
            if msg is not None:
                self.core.heard(msg, time.monotonic())
        self.core.tick(time.monotonic())
        self.link.check_alive()

    def on_wait(self) -> bool:
        """While a call waits for the servers: whether the wait is to end (ServerGroup's on_wait)."""
        self.hear()
        return self.core.interrupted()

    def on_refusal(self, refusal: ServerError) -> bool:
        """A server refused us: whether a rewind on its way explains it (ServerGroup's on_refusal)."""
        return self.core.refused(str(refusal), refusal.code, time.monotonic())
