"""The worker process: register, then compute, push and pull until the job ends."""

import logging
import os
import socket as pysocket
import time

import torch
import zmq

from omnips import data, fingerprint, models, routes
from omnips.batching import PROBE_BATCHES, PROBE_ROUNDS, BatchPlan, probe_agrees, probe_times
from omnips.flat import FlatModel
from omnips.leaving import Leaving
from omnips.link import LinkError, SchedulerLink
from omnips.protocol import MAX_REASON, Failed, Leave, Plan, Probe, Register, Report, Rewind, Shutdown
from omnips.servers import ServerGroup
from omnips.wire import WireDtype

from . import memory, threads
from .buckets import bucket_values
from .options import WorkerOptions
from .pushing import Pusher
from .trainer import Trainer, resolve_device

log = logging.getLogger("omnips.worker")

HOLD_BEATS = 2  # heartbeat intervals of the scheduler's silence after which no step starts


class JobEnded(Exception):
    """The scheduler closed the job (successfully) while this worker was busy or waiting."""


class Rewound(Exception):
    """A server died and the job went back to a checkpoint: continue from `msg.steps[rank]`."""

    def __init__(self, msg: Rewind):
        super().__init__(f"rewind to steps {msg.steps}")
        self.msg = msg


def run(opts: WorkerOptions, leaving: Leaving | None = None) -> int:
    device = resolve_device(opts.device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    ctx = zmq.Context()
    link = None
    try:
        link = SchedulerLink(ctx, opts.scheduler, keys=opts.keys)
        welcome = link.register(
            Register(role="worker", host=pysocket.gethostname(), capacity=opts.capacity, device=str(device),
                     threads=opts.threads, pid=os.getpid(), rank=opts.rank,  # 0: chosen at the welcome
                     memory_limit=opts.memory_limit, token=opts.token),
            opts.ack_timeout_s, opts.welcome_timeout_s)
        job, cluster = welcome.job, welcome.cluster
        if not opts.threads:
            _choose_threads(welcome.rank, welcome.worker.host_workers)
        link.dead_after_s, link.heartbeat_s = cluster.dead_after_s, cluster.heartbeat_s
        try:
            session = _Session(job, welcome.rank, cluster, welcome.worker, device, opts, link)
            session.leaving = leaving or Leaving()
            # on_wait twice per heartbeat interval: what a waiting worker's heartbeats say is that fresh
            session.connect = lambda servers, local: ServerGroup(
                ctx, routes.endpoints(servers, local, opts.transport), cluster.ranges, opts.server_timeout_s,
                on_wait=session.check_scheduler, tick_s=min(1.0, link.heartbeat_s / 2), keys=opts.keys,
                wire=session.wire)
            session.servers = session.connect(cluster.servers, cluster.ipc)
            return session.train()
        except JobEnded:
            log.info("worker %d: the scheduler closed the job", welcome.rank)
            return 0
        except LinkError:  # about the scheduler (silent, or it ended us): nothing to tell it
            raise
        except Exception as exc:
            # our last word: the scheduler re-plans at once instead of waiting out --dead-after
            # (the linger below gives it time to leave)
            reason = " ".join(f"worker {welcome.rank} on {pysocket.gethostname()}: {exc}".split())
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
    def __init__(self, job, rank, cluster, start, device, opts, link):
        self.job, self.rank, self.opts, self.link = job, rank, opts, link
        self.servers: ServerGroup | None = None
        self.connect = None  # (tcp endpoints, [host, ipc endpoint] pairs) -> a ServerGroup on them
        self.total_steps = start.total_steps
        # join_gen -1: there from the start; resumed: servers restored a checkpoint, go on from its
        # step and sample position
        self.join_gen, self.resumed = start.join_gen, start.resumed
        self.start_step, self.start_position = start.step, start.position
        self.plan = start.plan
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
        # dynamic batching plans the first step from every worker's timed passes (a joiner
        # and a resumed job go on with the plan they are given)
        self.probing = job.batching == "dynamic" and job.probe and self.join_gen < 0 and not self.resumed
        self.start_plan: BatchPlan | None = None  # the scheduler's answer to the probe
        live = device.type == "cpu" and not opts.emulation.active
        self.pusher = Pusher(self.flat, cluster.ranges, bucket_values(opts.bucket_bytes), live, self.wire)
        self.trainer.on_final_pass, self.trainer.on_retry = self.pusher.final_pass, self.pusher.settle
        bsp = job.mode == "bsp"
        # ASP: a stream per worker; one that joins later draws a stream of its own, not its rank's old one
        incarnation = 0 if self.join_gen < 0 else 1 + self.join_gen
        self.stream = data.SampleStream(len(train), job.seed,
                                        stream=0 if bsp else 1 + rank + job.num_workers * incarnation)
        log.info("worker %d on %s: %s, %d values, batch %d", rank, device, job.mode, self.flat.size,
                 self.plan.batches[rank])

    def train(self) -> int:
        """Train until the scheduler closes the job (JobEnded), this worker leaves it (a
        SIGTERM: 0, after the step in flight) or something fails."""
        bsp = self.job.mode == "bsp"
        asp_pos, last = self.start_position, None
        if self.join_gen < 0:
            if self.rank == 0 and not self.resumed:
                self.servers.init(self.flat.params)
            step = self.start_step
            self.servers.pull(self.flat.params)
        else:  # joining: BSP waits for the first step that runs the plan with this worker in it
            ex = self.servers.pull(self.flat.params, gen=self.join_gen)
            step = ex.versions[0] if bsp else self.start_step
            if ex.plan is not None:
                self.plan = ex.plan.sized(self.job.num_workers)
            log.info("worker %d joins at step %d", self.rank, step)
        self.flat.load_params()
        if self.probing:  # once the model is in place: the job's time counts from the probe
            sizes = list(PROBE_BATCHES)
            with self.link.in_phase("probing its speed"):
                seconds = self._probe(sizes)
            self.link.send(Probe(rank=self.rank, batches=sizes, seconds=seconds,
                                 mem_free=memory.free_bytes(self.flat.device), sample_bytes=self.sample_bytes))
            try:
                self._await_start_plan()
            except Rewound as rw:
                step, asp_pos = self._rewind(rw.msg)
        while not self.plan.stop and not (bsp and step >= self.total_steps):
            try:
                asp_pos, last = self._step(step, asp_pos, bsp)
                step += 1
            except Rewound as rw:
                step, asp_pos = self._rewind(rw.msg)
            if self.leaving.due():  # the scheduler re-plans the others at once, as for a lost worker
                self.link.send(Leave(why=self.leaving.why))
                log.warning("worker %d on %s: %s: leaving the job after step %d", self.rank,
                            pysocket.gethostname(), self.leaving.why, step - 1)
                return 0
        self.link.send(Report(rank=self.rank, step=step, batch=0, compute_s=0.0, network_s=0.0, wait_s=0.0,
                              loss=last.loss if last else 0.0, done=True))
        self._await_shutdown()

    def _probe(self, sizes: list[int]) -> list[float]:
        """Seconds of one forward and backward pass over the first `size` samples, for each
        of `sizes`, as this worker's (emulated) device takes them: the fastest of
        PROBE_ROUNDS passes, taken in turn, since on a busy host noise only adds time (one
        slow pass of a few samples moved a whole start plan), and more while the two sizes
        disagree (omnips/batching.probe_times). Nothing is pushed (the
        pusher is unhooked), the model's buffers (normalisation statistics the passes move)
        and the random state are left as the pull set them, and the gradient the passes
        leave is zeroed by the first step."""
        devices = [self.flat.device] if self.flat.device.type == "cuda" else []
        buffers = self.flat.params[self.flat.num_trained:].copy()
        hooks = self.trainer.on_final_pass, self.trainer.on_retry
        self.trainer.on_final_pass = self.trainer.on_retry = None
        try:
            with torch.random.fork_rng(devices=devices):
                seconds, rounds = probe_times(lambda size: self._pad(0, size, self.trainer.compute(
                    list(range(size)))[1]), sizes)
            if rounds > PROBE_ROUNDS:
                log.info("worker %d: probe passes of %s samples took %s s in %d rounds%s", self.rank, sizes,
                         [round(t, 4) for t in seconds], rounds,
                         "" if probe_agrees(sizes, seconds) else " and still disagree (a busy host?)")
            return seconds
        finally:
            self.trainer.on_final_pass, self.trainer.on_retry = hooks
            self.flat.params[self.flat.num_trained:] = buffers
            self.flat.load_params()

    def _await_start_plan(self) -> None:
        """Until the scheduler answers the probe with the first step's plan. It waits for
        every starting worker's probe (or for a silent one to be dropped): as long as the
        cluster may take to form, while the scheduler is heard from."""
        limit = self.opts.welcome_timeout_s
        deadline = time.monotonic() + limit
        while self.start_plan is None:
            if time.monotonic() > deadline:
                raise LinkError(f"no start plan from the scheduler within {limit:g} s (it waits for every "
                                "worker's probe)")
            self.link.sock.poll(1000 * min(1.0, self.link.heartbeat_s))
            self.check_scheduler()
        if self.start_plan.gen >= self.plan.gen:
            self.plan = self.start_plan
        log.info("worker %d starts with batch %d (plan %d)", self.rank, self.plan.batches[self.rank], self.plan.gen)

    def _rewind(self, msg: Rewind) -> tuple[int, int]:
        """Abandon the step in flight, connect to the servers as they are now, and pull the
        model of the checkpoint; the step and sample position to go on from."""
        if len(msg.steps) != self.job.num_workers:
            raise LinkError(f"a rewind for {len(msg.steps)} workers, the job has {self.job.num_workers}")
        step = msg.steps[self.rank]
        log.info("worker %d: a server was lost, the job goes back to step %d", self.rank, step)
        self.servers.close()
        self.servers = self.connect(msg.servers, msg.ipc)
        self.plan = msg.plan
        self.servers.pull(self.flat.params)  # BSP: the version stays the checkpoint's until all have pushed
        self.flat.load_params()
        return step, msg.positions[self.rank]

    def _step(self, step: int, asp_pos: int, bsp: bool) -> tuple[int, Report]:
        """One step: compute, push and pull, report; returns the ASP stream position and the report."""
        self._hold_for_scheduler(step)
        batch = self.plan.batches[self.rank]
        if not batch:
            raise LinkError(f"worker {self.rank} is no longer in the batch plan: the scheduler removed it")
        self.step = step
        self.link.state = {"phase": "computing", "step": step}
        if bsp:
            start = data.bsp_slice_start(step * self.job.global_batch, self.plan.batches, self.rank)
        else:
            start, asp_pos = asp_pos, asp_pos + batch
        before = list(self.servers.versions)
        self.pusher.begin(self.servers, self.rank, step, batch, self.plan.gen)
        loss, real_s = self.trainer.compute(self.stream.take(start, batch), poison=step in self.opts.fault_nan_at)
        compute_s = self._pad(step, batch, real_s)
        finite = self.pusher.finish()
        if not finite:
            self._nonfinite(step, batch, loss)
            self.pusher.drop()
        ex = self.servers.collect(step, self.flat.params, early=self.pusher.live)
        self.step = None
        self.flat.load_params()
        if ex.plan is not None:
            self.plan = ex.plan.sized(self.job.num_workers)
        staleness = max(0, max(v - 1 - b for v, b in zip(ex.versions, before)))
        last = Report(rank=self.rank, step=step, batch=batch, compute_s=compute_s,
                      network_s=max(0.0, ex.elapsed_s - ex.held_s), wait_s=ex.held_s, loss=loss,
                      staleness=staleness, mem_batch=self.trainer.max_batch,
                      mem_free=memory.free_bytes(self.flat.device),
                      sample_bytes=self.sample_bytes, nonfinite=not finite)
        self.link.send(last)
        self.check_scheduler()
        return asp_pos, last

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

    def _hold_for_scheduler(self, step: int) -> None:
        """A scheduler silent for HOLD_BEATS heartbeat intervals may be dead: a step taken now
        is work nobody records (its report, a checkpoint no manifest completes). Wait until it
        is heard again (a pause: the step goes on) or --dead-after passes (check_alive gives up)."""
        self.check_scheduler()
        if self.link.quiet_s() <= HOLD_BEATS * self.link.heartbeat_s:
            return
        log.info("worker %d: no word from the scheduler for %.1f s: step %d waits until it is heard", self.rank,
                 self.link.quiet_s(), step)
        while self.link.quiet_s() > HOLD_BEATS * self.link.heartbeat_s:
            self.link.sock.poll(int(1000 * self.link.heartbeat_s) + 1)
            self.check_scheduler()
        log.info("worker %d: the scheduler is heard again: step %d goes on", self.rank, step)

    def check_scheduler(self) -> None:
        """Handle what the scheduler sent; JobEnded when it closed the job, Rewound when
        it took the job back to a checkpoint, LinkError when it failed it or went silent.
        Our heartbeats (sent from here when due) say what we do: a step that waits for the
        servers, for how long and for which of them."""
        waiting = self.servers.waiting() if self.servers is not None and self.step is not None else None
        if waiting is not None:
            self.link.state = {"phase": "waiting for servers", "step": self.step, "waited_s": waiting[0],
                               "servers": waiting[1]}
        else:
            self.link.state = {"phase": "training"} if self.step is not None else {}
        while self.link.sock.poll(0):
            msg = self.link.receive()
            if isinstance(msg, Shutdown):
                raise JobEnded()
            if isinstance(msg, Rewind):
                raise Rewound(msg)
            if isinstance(msg, Plan) and self.probing and self.start_plan is None:
                try:
                    self.start_plan = msg.plan.sized(self.job.num_workers)
                except ValueError as exc:
                    raise LinkError(f"the scheduler sent a bad start plan: {exc}") from None
        self.link.check_alive()

    def _await_shutdown(self) -> None:
        deadline = time.monotonic() + self.opts.server_timeout_s
        while time.monotonic() < deadline:
            self.link.sock.poll(1000)
            self.check_scheduler()
        raise LinkError(f"finished, but the scheduler did not close the job within {self.opts.server_timeout_s:g} s")
