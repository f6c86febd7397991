"""The scheduler process: rendezvous, progress, evaluations, the run directory, shutdown.

The decisions live in registry.py, progress.py and evaluation.py; this module
moves messages between them and the sockets and writes what happened.
"""

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from omnips import codec, data, fingerprint, models, protocol, routes, security, transport
from omnips.batching import BatchPlan
from omnips.checkpoint import Manifest, newest_complete, set_aside_after
from omnips.flat import FlatModel
from omnips.job import PREEMPTED_EXIT, JobSpec
from omnips.metrics import RunDir, atomic_file
from omnips.protocol import (Ack, Checkpoint, Failed, Heartbeat, Leave, Params, Plan, Probe, ProtocolError, Register,
                             Report, Restore, Rewind, Saved, Shutdown)
from omnips.servers import ServerError, ServerGroup

from .checkpoints import CheckpointBook
from .disturbance import Disturbances
from .divergence import Diverged, LossWatch
from .evaluation import EvalBook, PendingEval
from .planning import Planner
from .progress import EvalPoint, Progress
from .registry import Registry
from .stalls import NOTICE_S, StallWatch
from .status_server import NoStatus, open_status
from .stopping import STOP_WAIT_S, Stop, on_leave

log = logging.getLogger("omnips.scheduler")

POLL_MS = 100
WAITING_SAY_S = 5.0  # while the cluster forms, how often the scheduler says who is still missing
ROUTER_BURST = 1000  # messages read from the router per loop turn, at most
EVALS_AHEAD = 32
CHECKPOINTS_AHEAD = 32  # BSP checkpoint requests kept waiting at the servers: one asked after its version
                        # passed is missed, and the loop can be busy evaluating for a while


@dataclass(frozen=True)
class SchedulerOptions:
    host: str = "127.0.0.1"
    port: int = 0
    run_dir: str = "runs/run"
    heartbeat_s: float = 1.0
    dead_after_s: float = 30.0
    register_timeout_s: float = 300.0
    stall_timeout_s: float = 300.0
    server_timeout_s: float = 120.0
    checkpoint_every: int = 0  # steps (BSP) or reported updates (ASP/SSP) between checkpoints; 0: none
    keys: security.Keys | None = None  # CURVE on every connection, clients from the allow-list only
    token: str = field(default="", repr=False)
    transport: str = "auto"  # how to reach servers on this host: auto (ipc) or tcp (omnips.routes)
    status_host: str = "127.0.0.1"
    status_port: int | None = None  # the status server's (0: any free one); None: none


class JobFailed(RuntimeError):
    pass


@dataclass
class Recovery:
    """A server was lost: the servers go back to `checkpoint`; `waiting` have not said so yet."""

    checkpoint: Manifest
    waiting: set[int]
    reached: int  # the furthest step reported before the loss
    lost: str = ""  # which server was lost, and why, in words
    since: float = 0.0  # when
    told_at: float = 0.0  # when the log last said what the job waits for


class Scheduler:
    def __init__(self, job: JobSpec, opts: SchedulerOptions, announce=print, resume: Manifest | None = None):
        """`resume`: continue the interrupted run in opts.run_dir from this checkpoint."""
        self.job, self.opts = job, opts
        self.announce = announce
        train, test = data.load(job.dataset, job.dataset_args)
        self.flat = FlatModel(models.build(job.model, job.model_args, train, job.seed))
        self.test_batcher, self.test_size = data.Batcher(test), len(test)
        self.progress = Progress(job, len(train))
        self.resume = resume
        if resume is not None:
            self.progress.resume(resume.worker_steps, resume.positions)
        checkpoints = Path(opts.run_dir).resolve() / "checkpoints"  # absolute: servers elsewhere write there
        self.registry = Registry(job, self.flat.size, self.flat.num_trained, self.progress.total_steps,
                                 opts.dead_after_s, opts.heartbeat_s, str(checkpoints), resume, opts.token)
        self.registry.fingerprints = {"model": fingerprint.model(self.flat.module),
                                      "data": fingerprint.data(train, test)}
        self.stalls = StallWatch(job.mode, opts.heartbeat_s)  # which rank a stalled step waits for
        self._phase: dict[bytes, str] = {}  # registered peer -> what its last heartbeat said it was doing
        # with --checkpoint-every 0 too: a preemption writes one
        self.checkpoints = CheckpointBook(checkpoints, job, self.registry.ranges, opts.checkpoint_every,
                                          resume.step if resume else 0)
        self._checkpoint_steps = range(0)
        self.evals = EvalBook(job.num_servers)
        self.final: tuple[float, float] | None = None
        self.servers: ServerGroup | None = None
        self._bsp_points: list[EvalPoint] = []
        self.nonfinite = 0  # gradients with NaN or inf the workers reported
        self.losses = LossWatch(job, len(train), resumed=resume is not None)
        self.disturbances = Disturbances()  # evaluations and checkpoint writes: steps then are not measured
        self.lost, self.left, self.joined = 0, 0, 0  # workers (left: a SIGTERM)
        self.restores = 0  # times a lost server's shard was taken over and the job went back
        self._recovery: Recovery | None = None
        self._heard: dict[bytes, float] = {}  # registered peer -> when it last said anything
        self._plan_logged = False
        self._done_at: float | None = None
        self._stop_asked: str | None = None  # what asked for a stop (request_stop), until it is begun
        self._stop: Stop | None = None
        self._complete_at = 0.0
        self._waiting_said = 0.0  # when (s after the start) the scheduler last said who it waits for
        self._next_beat = 0.0
        self.ctx = zmq.Context()
        self.gate = security.Gate(self.ctx, opts.keys) if opts.keys else None
        self.router = transport.socket(self.ctx, zmq.ROUTER)
        self.router.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_HEADER_BYTES)  # the scheduler takes headers only
        self.status = NoStatus()
        try:
            # bound before the run directory is touched: a scheduler that cannot listen leaves no
            # run behind, and a resumed run's checkpoints as they were
            self.endpoint = transport.bind(self.router, opts.host, opts.port, opts.keys)
            self.status = open_status(job.to_dict(), opts.run_dir, opts.status_host, opts.status_port, opts.token)
            self.run = RunDir(opts.run_dir, resume=resume is not None)
            self.status.attach(self.run, resumed=resume is not None)
            if resume is None:
                self.run.write_config(job.to_dict())
            else:
                for old, new in set_aside_after(checkpoints, resume.step):
                    log.warning("set aside %s as %s: newer than checkpoint %d resumed from, which passed it over",
                                old, new.name, resume.step)
        except BaseException:
            self._close(linger=0)
            raise
        self.planner = Planner(job, self.registry, self.run)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)

    # -- lifecycle ----------------------------------------------------------------
    def serve(self) -> int:
        try:
            self.status.announce(self.announce)  # first: a launcher reads up to the address
            self.announce(f"omnips scheduler listening on {self.endpoint}", flush=True)
            if self.resume is not None:
                self.run.event("resume", step=self.resume.step, checkpoint=str(self.resume.path))
                log.info("resuming from checkpoint %s (step %d)", self.resume.path, self.resume.step)
            self.run.event("start", endpoint=self.endpoint, clock_t0=self.run.t0, num_params=self.flat.size,
                           train_size=self.progress.train_size,
                           test_size=self.test_size, budget_samples=self.progress.budget,
                           budget_epochs=self.progress.budget / self.progress.train_size)
            log.info("job: %s, %d server(s), %d worker(s), %d parameters, run dir %s", self.job.mode,
                     self.job.num_servers, self.job.num_workers, self.flat.size, self.run.path)
            log.info("connections: %s; %s", security.describe(self.opts.keys),
                     "a job token is required" if self.opts.token else "no job token")
            self._loop()
        except (JobFailed, ServerError, transport.TransportError) as exc:
            return self._finish(f"failed: {exc}")
        except KeyboardInterrupt:
            return self._finish("failed: interrupted")
        if self._stop is None:
            return self._finish("completed")
        return self._finish("interrupted" if self._stop.why == "SIGINT" else "preempted",  # Ctrl-C, or a batch system
                            self._stop.detail(self.progress.steps, model=self.final is not None))

    def request_stop(self, why: str) -> None:
        """From a signal handler: preempt the job at the next loop turn, writing the model and
        a checkpoint first; asked again before that begins, end it at once."""
        if self._stop_asked is not None or self._stop is not None:
            raise KeyboardInterrupt
        self._stop_asked = why

    def _finish(self, status: str, stopped: str | None = None) -> int:
        """`stopped`: what a stop asked by a signal saved (the job can be resumed)."""
        ok = status == "completed"
        said = f"{status}: {stopped}" if stopped else status
        (log.info if ok else log.warning if stopped else log.error)("job %s", said)
        for member in self.registry.by_peer.values():
            self._tell(member.peer, Shutdown(ok=ok, reason=said, preempted=stopped is not None))
        self.run.event("end", status=status, stopped=stopped)
        self.run.flush()
        try:
            self.run.write_summary({**self._summary(status), "stopped": stopped})
        except OSError as exc:
            log.error("cannot write the summary of the job (%s): %s", said, exc)
            ok, stopped = False, None
        self.run.close()
        self._close(linger=transport.LINGER_MS)
        return 0 if ok else PREEMPTED_EXIT if stopped else 1

    def _close(self, linger: int) -> None:
        self.status.close()
        if self.gate is not None:
            self.gate.stop()
        self.ctx.destroy(linger=linger)

    def _ended(self) -> bool:
        if self._stop is None:
            return self.progress.all_done and self.final is not None
        return (self.final is not None and self._stop.saved) or time.monotonic() > self._stop.deadline

    def _loop(self) -> None:
        start = time.monotonic()
        while not self._ended():
            events = dict(self.poller.poll(POLL_MS))
            now = time.monotonic()
            if self.router in events:
                for _ in range(ROUTER_BURST):  # all that waits: a lagging loop would misjudge silences
                    self._on_router()
                    if not self.router.poll(0):
                        break
            if self.servers is not None:
                for s, sock in enumerate(self.servers.socks):
                    if sock in events:
                        self._on_server(s, transport.recv_frames(sock))
            if self._stop_asked is not None or self._stop is not None:
                self._stopping(now)
            self._heartbeat()
            self.status.tick(now)
            self._check_timeouts(start, now)
            self._tell_waits(now)

    def _heartbeat(self) -> None:
        """Heartbeats to every member when due; also called during long evaluations."""
        now = time.monotonic()
        if now < self._next_beat:
            return
        self._check_own_silence(now)
        for member in self.registry.by_peer.values():
            self._tell(member.peer, Heartbeat())
        self._next_beat = now + self.opts.heartbeat_s
        self.run.flush()

    def _check_own_silence(self, now: float) -> None:
        """A scheduler that sent nothing for longer than the processes wait for it (--dead-after
        and a heartbeat's grace) was stalled (stopped, or starved of CPU): the servers and
        workers have given up on it, and it ends the job saying so, rather than find them
        silent one by one --dead-after later and blame the first for the job's end."""
        if not self.registry.complete or not self._next_beat:  # until their welcome, processes wait 30 s
            return
        silent = now - (self._next_beat - self.opts.heartbeat_s)
        if silent > self.opts.dead_after_s + self.opts.heartbeat_s:
            raise JobFailed(f"the scheduler sent nothing for {silent:.0f} s (it was stalled: stopped, or starved of "
                            f"CPU), longer than --dead-after ({self.opts.dead_after_s:g} s), after which the "
                            "servers and workers give up on it" + self._recovery_hint())

    def _tell_waits(self, now: float) -> None:
        """Say what a stalled job waits for: a lost server's replacement, or the rank a step waits for."""
        rec = self._recovery
        if rec is not None:
            if now - rec.told_at >= NOTICE_S:
                rec.told_at = now
                what = (f"a server to take the shard of {rec.lost}: start one with the server's command line; the "
                        "workers give up after their --server-timeout" if self.registry.vacant_servers else
                        f"servers {sorted(rec.waiting)} to restore checkpoint {rec.checkpoint.step}")
                log.warning("the job waits for %s (%.0f s since the loss)", what, now - rec.since)
            return
        told = self.stalls.notice(now)
        if told is not None:  # a wait of a few step times is news; one past NOTICE_S, a warning
            change, wait = told
            if change == "waits":
                (log.warning if wait.seconds >= NOTICE_S else log.info)("%s", wait)
            else:
                log.info("step %d went on after %.1f s", wait.step, wait.seconds)
            self.run.event("wait", change=change, **wait._asdict())

    def _check_timeouts(self, start: float, now: float) -> None:
        if not self.registry.complete:
            if now - start > self.opts.register_timeout_s:
                raise JobFailed(f"cluster incomplete after {self.opts.register_timeout_s:g} s: "
                                f"missing {self.registry.missing()}")
            if now - start > self._waiting_said + WAITING_SAY_S:  # say who is missing, not only at the timeout
                self._waiting_said = now - start
                log.info("waiting for %s (%.0f s of --register-timeout %g s)", self.registry.missing(), now - start,
                         self.opts.register_timeout_s)
        elif self.progress.all_done:
            if self._done_at is None:
                self._done_at = now
            elif now - self._done_at > self.opts.server_timeout_s:
                raise JobFailed(f"servers did not answer the final evaluation pull within "
                                f"{self.opts.server_timeout_s:g} s")
        elif now - (self.progress.last_report or self._complete_at) > self.opts.stall_timeout_s:
            raise JobFailed(f"no progress reported for {self.opts.stall_timeout_s:g} s" + self._recovery_hint())
        elif not self.router.poll(0):  # judge silences only with nothing unread
            self._check_silences(now)

    def _stopping(self, now: float) -> None:
        """A stop was asked (request_stop): the workers stop after their step in flight (the
        plan that ends an ASP job), then the model and a checkpoint are asked of the servers
        (Stop.save_now). A job that has not trained yet ends at once."""
        if self._stop is None:
            trained = self.progress.last_end is not None
            self._stop = Stop(self._stop_asked, now, STOP_WAIT_S if trained else 0.0)
            self._stop_asked = None
            if trained:
                log.warning("%s: preempted: the workers stop after their step in flight, then model.pt and a "
                            "checkpoint are written (within %g s)", self._stop.why, STOP_WAIT_S)
                plan = self.registry.plan
                if not plan.stop:
                    self._send_plan(BatchPlan(plan.gen + 1, plan.batches, stop=True))
        if self._stop.save_now(self.progress.all_done, now):
            self._stop.saving = True
            if self.job.mode == "bsp" or not self.evals.final_asked:  # (ASP/SSP: asked as the last worker stops)
                self._ask_eval(EvalPoint(self.progress.epochs, None), final=True)
            steps = self.progress.steps  # BSP: at the version where every worker stopped
            self._stop.checkpoint_req = self._ask_checkpoint(steps, steps if self.job.mode == "bsp" else None)

    def _recovery_hint(self) -> str:
        """How the user can go on after a failure, if a checkpoint allows it."""
        if self.checkpoints is None or not self.checkpoints.complete:
            return ""
        return f"; start the processes again with --resume {self.run.path} on the scheduler"

    def _server_lost(self, m, why: str) -> None:
        """With a complete checkpoint, every server goes back to it, the lost one's shard on
        whichever server registers next; without one, the job fails."""
        ckpt = None
        if self.checkpoints is not None and self._recovery is None:
            ckpt, _ = newest_complete(self.checkpoints.root)
        if ckpt is None:
            raise JobFailed(f"server {m.rank} at {m.info.endpoint} {why}" + self._recovery_hint())
        # a server only frozen reads this when it wakes, and ends instead of serving the workers
        self._tell(m.peer, Shutdown(ok=False, reason=f"removed from the job: server {m.rank} {why}"))
        self.registry.vacate_server(m.rank)
        self._heard.pop(m.peer, None)
        reached = max((w.next_step or 0 for w in self.progress.workers if w.present), default=0)
        now = time.monotonic()
        self._recovery = Recovery(ckpt, set(range(self.job.num_servers)), reached,
                                  f"server {m.rank} on {m.info.host} ({why})", now, now)
        for other in self.registry.servers:
            if other.rank != m.rank:
                self._tell(other.peer, Restore(path=str(ckpt.path)))
        self._membership(m, "lost", reason=why)
        log.warning("server %d lost (%s): start a server again; the job goes back to step %d", m.rank, why, ckpt.step)

    def _replace_silent_server(self) -> None:
        """A server registers while every shard has one: one that has missed two heartbeats
        is taken for lost now rather than after --dead-after (a supervisor restarting a
        crashed server need not wait); with all of them alive the newcomer is refused."""
        now = time.monotonic()
        for m in self.registry.servers:
            silent = self._silent(m, now)
            if silent > 2 * self.opts.heartbeat_s:
                self._server_lost(m, f"silent for {silent:.1f} s when a new server registered")
                return

    def _on_restored(self, rank: int) -> None:
        """A server is back at the checkpoint; once all are, the workers go back too."""
        if self._recovery is None:
            return  # restored at its welcome when the job was resumed
        self._recovery.waiting.discard(rank)
        if self._recovery.waiting:
            return
        ckpt, reached = self._recovery.checkpoint, self._recovery.reached
        self._recovery = None
        self.progress.resume(ckpt.worker_steps, ckpt.positions)
        for sock in self.servers.socks:  # evaluation and checkpoint requests died with the rewind
            self.poller.unregister(sock)
        self.servers.close()
        self.evals = EvalBook(self.job.num_servers)
        self.checkpoints.rewind(ckpt.step)
        self._connect_servers()
        plan = BatchPlan(self.registry.plan.gen + 1, self.registry.plan.batches)
        self._send_plan(plan)
        endpoints = [s.info.endpoint for s in self.registry.servers]
        rewind = Rewind(steps=list(ckpt.worker_steps), positions=list(ckpt.positions), plan=plan.to_wire(),
                        servers=endpoints, ipc=self.registry.local_endpoints())
        for w in self.registry.workers.values():
            self._tell(w.peer, rewind)
            self.stalls.seat(w.rank, w.info.host, w.info.device, time.monotonic())  # their steps start again
        self.restores += 1
        self.run.event("rewind", step=ckpt.step, worker_steps=list(ckpt.worker_steps),
                       steps_lost=max(0, reached - max(ckpt.worker_steps)), checkpoint=str(ckpt.path))
        log.info("every server is back at checkpoint %d: the workers go on from steps %s", ckpt.step,
                 list(ckpt.worker_steps))

    def _silent(self, m, now: float) -> float:
        """Seconds since member `m` last said anything, counted from the start at the
        earliest: until their welcome, processes beat at the default rate."""
        return now - max(self._heard.get(m.peer, 0.0), self._complete_at)

    def _check_silences(self, now: float) -> None:
        """A worker silent for --dead-after leaves the job; a silent server is replaced or
        fails it."""
        for m in self.registry.servers:
            silent = self._silent(m, now)
            if silent > self.opts.dead_after_s and m.rank not in self.registry.vacant_servers:
                self._server_lost(m, f"has been silent for {silent:.0f} s{self._last_phase(m)}")
        for rank, m in list(self.registry.workers.items()):
            silent = self._silent(m, now)
            if silent > self.opts.dead_after_s and not self.progress.workers[rank].done:
                self._depart(rank, f"silent for {silent:.0f} s{self._last_phase(m)}")

    def _last_phase(self, m) -> str:
        """What a silent member last said it was doing: at start-up, which phase it was in."""
        phase = self._phase.get(m.peer)
        return f", last heard {phase}" if phase else ""

    # -- messages -----------------------------------------------------------------
    def _on_router(self) -> None:
        peer, *frames = transport.recv_frames(self.router)
        peer = peer.bytes
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            log.warning("refused a message: %s", exc)
            self._tell(peer, protocol.Error(code=exc.code, text=exc.text))
            return
        if isinstance(msg, Register) and msg.role == "server" and not self._job_key(frames[0]):
            self._refuse(peer, "bad_key", "a server registers with the key directory 'omnips keygen' made, "
                                          "not with one machine's client key (--client): it holds no server secret")
            return
        self._on_message(peer, msg)

    def _job_key(self, frame) -> bool:
        """With --keys, whether the peer connected with the job's own client key (the gate
        names each connection by its key); without, anyone may."""
        return self.opts.keys is None or frame.get("User-Id") == self.opts.keys.client_public.decode()

    def _on_message(self, peer: bytes, msg: protocol.Message) -> None:
        server = getattr(self.registry.by_peer.get(peer), "role", "") == "server"
        if isinstance(msg, Register):
            self._on_register(peer, msg)
        elif isinstance(msg, Report):
            self._on_report(peer, msg)
        elif isinstance(msg, Probe):
            self._on_probe(peer, msg)
        elif isinstance(msg, Ack) and server:
            self._on_restored(self.registry.by_peer[peer].rank)
        elif isinstance(msg, protocol.Error) and server:
            # a server that cannot take its shard back from a checkpoint: nothing to go on from
            raise JobFailed(f"{msg.code}: {msg.text}")
        elif isinstance(msg, Leave) and peer in self.registry.by_peer:
            self._on_leave(self.registry.by_peer[peer], msg.why)
        elif isinstance(msg, Heartbeat):
            if msg.echo and peer in self.registry.by_peer:  # at once: whatever we sent it before goes first
                self._tell(peer, Heartbeat(echo=msg.echo))
            self._on_beat(peer, msg)
        elif isinstance(msg, Failed):
            self._on_failed(peer, msg)
        else:
            self._refuse(peer, "bad_op", f"the scheduler does not take {msg.OP!r}")
        if peer in self.registry.by_peer:  # registered (now): any word proves it alive
            self._heard[peer] = time.monotonic()

    def _on_leave(self, m, why: str) -> None:
        """A process's SIGTERM (stopping.on_leave): a worker has left after its step in flight;
        a server's, or the last worker's, preempts the job."""
        if m.role == "worker" and not (m.rank in self.registry.workers and self.progress.workers[m.rank].present):
            return  # not ranked yet, or already gone
        who = f"{why} to {m.role} {m.rank} on {m.info.host}"
        stopping = self._stop_asked is not None or self._stop is not None
        others = sum(w.present for r, w in enumerate(self.progress.workers) if r != m.rank)
        action = on_leave(m.role, stopping, others)
        if action == "depart":
            self._depart(m.rank, who, change="left")
            return
        if m.role == "worker":  # it has stopped after its step in flight: no step waits for it
            self.progress.workers[m.rank].done = True
        if not stopping:
            self._stop_asked = who

    def _on_beat(self, peer: bytes, msg: Heartbeat) -> None:
        member = self.registry.by_peer.get(peer)
        if member is None:
            return
        self._phase[peer] = msg.phase
        if member.role == "worker" and member.rank in self.registry.workers:
            self.stalls.on_beat(member.rank, msg.step, msg.waited_s, msg.servers, time.monotonic())
        elif member.role == "server":
            self.stalls.on_server_beat(member.rank, time.monotonic())

    def _on_failed(self, peer: bytes, msg: Failed) -> None:
        """A process's last word before it exits: act on it now rather than on its silence."""
        member = self.registry.by_peer.get(peer)
        if member is None:  # gone already, or never in the job: nothing waits for it
            log.info("%s exits: %s", self.registry.describe(peer), msg.reason)
        elif member.role == "worker" and member.rank in self.registry.workers:
            self._depart(member.rank, f"failed: {msg.reason}")
        elif member.role == "server" and self.registry.complete:
            self._server_lost(member, f"failed: {msg.reason}")
        else:  # a server before the job started
            raise JobFailed(f"{member} failed: {msg.reason}")

    def _tell(self, peer: bytes, msg: protocol.Message) -> None:
        transport.reply(self.router, peer, msg, name=lambda: self.registry.describe(peer))

    def _refuse(self, peer: bytes, code: str, text: str) -> None:
        log.warning("refused a message: %s: %s", code, text)
        self._tell(peer, protocol.Error(code=code, text=text))

    def _on_register(self, peer: bytes, msg: Register) -> None:
        if (msg.role == "server" and self.registry.complete and not self.registry.vacant_servers
                and self.registry.refusal(peer, msg) is None):  # another job's process removes nobody
            self._replace_silent_server()
        servers_before = len(self.registry.servers) == self.job.num_servers
        for to, out in self.registry.register(peer, msg):
            self._tell(to, out)
            if isinstance(out, protocol.Error):
                log.warning("refused a registration: %s", out.text)
        member = self.registry.by_peer.get(peer)
        if member is not None and member.info is msg:
            log.info("%s registered from %s (pid %d)", msg.role, msg.host, msg.pid)
        if not servers_before and len(self.registry.servers) == self.job.num_servers:
            for server in self.registry.servers:  # ranks are final only now
                self._membership(server)
                self.stalls.servers[server.rank] = server.info.host
            self._connect_servers()
        if self.registry.complete and not self._plan_logged:
            self._plan_logged = True
            self._complete_at = time.monotonic()
            for worker in self.registry.workers.values():  # ranks are final only now
                self.progress.seat(worker.rank, joined=False)
                self.stalls.seat(worker.rank, worker.info.host, worker.info.device, self._complete_at)
                self._membership(worker)
            plan = self.planner.start(probe=self.job.probe and self.resume is None)  # a resumed job's workers go on
            log.info("cluster complete; batches %s", list(plan.batches))
            self._send_plan(plan)  # every server learns whom a step waits for
        for member in self.registry.joined:
            self._join(member)
        self.registry.joined.clear()
        for member in self.registry.reseated:  # takes a lost server's shard, from the checkpoint
            self.stalls.servers[member.rank] = member.info.host
            self._tell(member.peer, self.registry.server_welcome(member, restore=str(self._recovery.checkpoint.path)))
            self._membership(member, "joined", late=True)
        self.registry.reseated.clear()

    def _membership(self, m, change: str = "joined", **more) -> None:
        i = m.info
        self.run.event("membership", change=change, role=m.role, rank=m.rank, host=i.host, pid=i.pid,
                       device=i.device, threads=i.threads, capacity=i.capacity, endpoint=i.endpoint, ipc=i.ipc,
                       **more)

    def _join(self, member) -> None:
        """A worker took a vacant rank in the running job: a plan that gives it a share, then
        its welcome (BSP: it starts at the first step of that plan; ASP/SSP: at the slowest
        present worker's step, so that SSP's bound does not hold everyone back for it)."""
        steps = [w.next_step for w in self.progress.workers if w.present and w.next_step is not None]
        self.progress.seat(member.rank, joined=True)
        self.stalls.seat(member.rank, member.info.host, member.info.device, time.monotonic())
        plan = self._membership_plan(sorted(self.registry.workers), "joined")
        self._send_plan(plan)
        self._tell(member.peer,
                   self.registry.worker_welcome(member, join_gen=plan.gen, start_step=min(steps, default=0)))
        self.joined += 1
        self._membership(member, "joined", late=True)
        log.info("worker %d joined from %s: batches %s", member.rank, member.info.host, list(plan.batches))

    def _depart(self, rank: int, why: str, change: str = "lost") -> None:
        """Worker `rank` is gone (lost, or left): servers stop waiting for its later steps and
        the others share its part of the global batch from the next plan on."""
        w = self.progress.workers[rank]
        last = w.next_step - 1 if w.next_step is not None else -1
        member = self.registry.depart(rank)
        self.progress.depart(rank)
        self._heard.pop(member.peer, None)
        self._tell(member.peer, Shutdown(ok=False, reason=f"removed from the job: {why}"))
        if change == "lost":
            self.lost += 1
        else:
            self.left += 1
        self.stalls.leave(rank)
        self._membership(member, change, reason=why, last_step=last)
        log.warning("worker %d %s (%s) after step %d", rank, change, why, last)
        rec = self._recovery
        if not self.registry.workers and rec is not None:  # they gave up on the lost server, not the reverse
            missing = "no server took its shard" if self.registry.vacant_servers else "the servers did not restore"
            raise JobFailed(f"{rec.lost} was lost {time.monotonic() - rec.since:.0f} s ago and {missing}: every "
                            f"worker gave up waiting (the last, worker {rank}: {why})" + self._recovery_hint())
        if not self.registry.workers:
            raise JobFailed(f"every worker is gone (the last, worker {rank}: {why})")
        plan = self.registry.plan
        if not plan.stop:
            plan = self._membership_plan(sorted(self.registry.workers), "lost")
        self._send_plan(plan, departed=[[rank, last]])
        self._ask_final_eval_if_done()
        self._start_plan(self._planned(self.planner.departed, rank))

    def _membership_plan(self, active: list[int], change: str) -> BatchPlan:
        return self._planned(self.planner.membership, active, change,
                             max((w.next_step or 0 for w in self.progress.workers if w.present), default=0))

    def _planned(self, decide, *args) -> BatchPlan | None:
        """decide(*args), a Planner's decision; a plan the workers cannot run fails the job."""
        try:
            return decide(*args)
        except ValueError as exc:
            raise JobFailed(str(exc)) from None

    def _connect_servers(self) -> None:
        endpoints = routes.endpoints([m.info.endpoint for m in self.registry.servers],
                                     self.registry.local_endpoints(), self.opts.transport)
        self.servers = ServerGroup(self.ctx, endpoints, self.registry.ranges, self.opts.server_timeout_s,
                                   keys=self.opts.keys)
        for sock in self.servers.socks:
            self.poller.register(sock, zmq.POLLIN)
        if self.job.mode == "bsp":
            self._bsp_points = list(self.progress.bsp_eval_points())
            self._ask_bsp_evals()
            if self.checkpoints is not None:
                self._checkpoint_steps = self.checkpoints.bsp_steps(self.progress.total_steps)
                self._ask_bsp_checkpoints()

    def _ask_bsp_evals(self) -> None:
        """Keep EVALS_AHEAD evaluation pulls waiting at the servers (each a queued message there)."""
        while self._bsp_points and len(self.evals.pending) < EVALS_AHEAD:
            point = self._bsp_points.pop(0)
            self._ask_eval(point, final=point.at == self.progress.total_steps)

    def _on_report(self, peer: bytes, r: Report) -> None:
        if not self.registry.complete:
            self._refuse(peer, "not_started", "the job has not started")
            return
        member = self.registry.by_peer.get(peer)
        if member is None or member.role != "worker" or member.rank != r.rank:
            self._refuse(peer, "bad_rank", "report from an unregistered peer or the wrong rank")
            return
        if not self.progress.expects(r):
            if self.progress.stale(r):  # not an error: it crossed the rewind on its way here
                log.info("worker %d's report for step %d was sent before the rewind: dropped", r.rank, r.step)
            else:
                self._refuse(peer, "bad_step", f"report for step {r.step}, expected {self.progress.next_step(r.rank)}")
            return
        top = self.job.batch_bounds[1]
        if r.batch > top:  # it would count samples no step took (an ASP job's budget)
            self._refuse(peer, "bad_batch", f"report of a batch of {r.batch}, the job's largest is {top}")
            return
        if not r.done:
            self._diverged(self.losses.on_loss(r.loss, r.batch, r.rank, r.step, finite_gradient=not r.nonfinite))
        if r.nonfinite:
            self.nonfinite += 1
            self.run.event("nonfinite", worker=r.rank, step=r.step, loss=r.loss, policy=self.job.nan_policy)
            if self.job.nan_policy == "fail":
                raise JobFailed(f"worker {r.rank}'s gradient at step {r.step} has NaN or inf values "
                                f"(loss {r.loss:g}); --nan-policy skip would drop such gradients instead"
                                + ("; float16 on the wire turns |values| >= 65520 into inf"
                                   if self.job.wire_dtype == "float16" else ""))
            log.warning("worker %d's gradient at step %d has NaN or inf values: dropped", r.rank, r.step)
        for point in self.progress.on_report(r, time.monotonic()):
            self._ask_eval(point, final=False)
        self.stalls.on_report(r.rank, r.step, time.monotonic())
        if r.done:
            self.stalls.leave(r.rank)
            log.info("worker %d finished after %d steps", r.rank, r.step)
            self._ask_final_eval_if_done()
            return
        disturbed = self.disturbances.touches(time.monotonic(), r.compute_s + r.network_s + r.wait_s)
        self.run.step(r, self.progress.epochs, disturbed)
        if self.checkpoints is not None and self.job.mode != "bsp" and not self.registry.plan.stop:
            updates = sum(w.steps for w in self.progress.workers)
            if self.checkpoints.due(updates):
                self._ask_checkpoint(updates, None)
        if self.job.mode != "bsp" and self.progress.budget_reached and not self.registry.plan.stop:
            plan = self.registry.plan
            self._send_plan(BatchPlan(plan.gen + 1, plan.batches, stop=True))
            log.info("sample budget reached: asking workers to stop")
        elif self.planner.control is not None and not self.registry.plan.stop:
            plan = self._planned(self.planner.on_report, r, disturbed)
            if plan is not None:
                self._send_plan(plan)

    def _on_probe(self, peer: bytes, msg: Probe) -> None:
        """A worker's timed passes before its first step: once every starting worker's are in,
        the first step's plan, sent to the servers and to each worker (which waits for it)."""
        member = self.registry.by_peer.get(peer)
        if member is None or member.role != "worker" or member.rank != msg.rank:
            self._refuse(peer, "bad_rank", "probe from an unregistered peer or the wrong rank")
            return
        if msg.rank not in self.planner.probing:
            self._refuse(peer, "bad_step", f"no probe expected from worker {msg.rank}: the job is past its start")
            return
        plan = self._planned(self.planner.on_probe, msg)
        self.progress.on_probe(sum(msg.seconds), time.monotonic())
        self._start_plan(plan)

    def _start_plan(self, plan: BatchPlan | None) -> None:
        """The first step's plan (None: probes still awaited), to the servers and every worker."""
        if plan is None:
            return
        self._send_plan(plan)
        for m in self.registry.workers.values():
            self._tell(m.peer, Plan(gen=plan.gen, batches=list(plan.batches), stop=plan.stop))

    def _send_plan(self, plan: BatchPlan, departed=()) -> None:
        """Every server hands the plan on with its replies; a worker takes the newest it
        gets in a step's replies, which every BSP worker gets alike: all switch at one step."""
        self.planner.set(plan)
        for m in self.registry.servers:
            self._tell(m.peer, Plan(gen=plan.gen, batches=list(plan.batches), stop=plan.stop,
                                                      departed=list(departed)))

    def _ask_final_eval_if_done(self) -> None:
        """ASP/SSP: once every worker present has stopped, by its last report or by leaving the
        job (found silent after the others had finished), the model is read as the servers hold
        it. (BSP asks for its final version in advance.)"""
        if self.job.mode != "bsp" and self.progress.all_done and not self.evals.final_asked:
            self._ask_eval(EvalPoint(self.progress.samples / self.progress.train_size, None), final=True)

    def _ask_eval(self, point: EvalPoint, final: bool) -> None:
        try:
            self.servers.send_pull(self.evals.open(point, final), point.at)
        except zmq.ZMQError as exc:
            raise JobFailed(f"cannot ask the servers for an evaluation: {exc}") from None

    # -- checkpoints --------------------------------------------------------------
    def _ask_bsp_checkpoints(self) -> None:
        while self._checkpoint_steps and len(self.checkpoints.pending) < CHECKPOINTS_AHEAD:
            step, self._checkpoint_steps = self._checkpoint_steps[0], self._checkpoint_steps[1:]
            self._ask_checkpoint(step, step)

    def _ask_checkpoint(self, step: int, at: int | None) -> int | None:
        """The request's number, None if it could not be sent."""
        req = self.checkpoints.open(step, *self.progress.restart_point(at))
        try:
            self.servers.broadcast(Checkpoint(req=req, step=step, at=at))
        except zmq.ZMQError as exc:
            del self.checkpoints.pending[req]
            log.warning("checkpoint %d not taken: cannot ask the servers: %s", step, exc)
            return None
        return req

    def _on_saved(self, s: int, msg: Saved) -> None:
        now = time.monotonic()
        self.disturbances.add(now - msg.write_s, now)
        outcome = self.checkpoints.add(s, msg) if self.checkpoints is not None else None
        if outcome is None:
            return
        step, failure = outcome
        self.run.event("checkpoint", step=step, complete=failure is None, error=failure)
        if self._stop is not None:
            self._stop.on_checkpoint(msg.req, step, failure)
        if failure is None:
            log.info("checkpoint %d complete", step)
        else:
            log.warning("checkpoint %d is incomplete: %s", step, failure)
        if self.job.mode == "bsp":
            self._ask_bsp_checkpoints()

    def _on_server(self, s: int, frames: list) -> None:
        try:
            msg = self.servers.decode_reply(s, frames)
        except ServerError as exc:
            log.warning("a server refused a request: %s", exc)
            return
        if isinstance(msg, Saved):
            self._on_saved(s, msg)
            return
        if not isinstance(msg, Params):
            return
        self.servers.accept(s, msg, None)
        done = self.evals.add(s, msg)
        if done is not None:
            self._evaluate(done)

    def _evaluate(self, e: PendingEval) -> None:
        start = time.monotonic()
        for s, msg in e.shards.items():
            lo, hi = self.registry.ranges[s]
            np.copyto(self.flat.params[lo:hi], msg.data)
        self.flat.load_params()
        if e.final:  # first: a stop's deadline may come during the evaluation
            self._export_model()
        acc, loss = models.evaluate(self.flat.module, self.test_batcher, self.test_size, tick=self._heartbeat)
        self.disturbances.add(start, time.monotonic())
        versions = [e.shards[s].version for s in sorted(e.shards)]
        self.run.event("eval", epoch=e.point.epoch, versions=versions, test_accuracy=acc, test_loss=loss,
                       final=e.final)
        log.info("epoch %.2f: test accuracy %.4f, loss %.4f", e.point.epoch, acc, loss)
        self._diverged(self.losses.on_eval())
        if e.final:
            self.final = (acc, loss)
        self._ask_bsp_evals()

    def _diverged(self, verdict: Diverged | None) -> None:
        if verdict is not None:
            log.warning("training diverged: %s; %s", verdict.reason, verdict.hint)
            self.run.event("diverged", reason=verdict.reason, hint=verdict.hint)

    def _export_model(self) -> None:
        path = Path(self.run.path) / "model.pt"
        try:
            with atomic_file(path, "wb") as f:
                torch.save(self.flat.module.state_dict(), f)
        except OSError as exc:
            raise JobFailed(f"cannot write {path}: {exc}") from None

    # -- outputs ------------------------------------------------------------------
    def _summary(self, status: str) -> dict:
        plan = self.registry.plan
        acc, loss = self.final if self.final else (None, None)
        return {
            "status": status,
            "mode": self.job.mode,
            "batching": self.job.batching,
            "num_workers": self.job.num_workers,
            "num_servers": self.job.num_servers,
            "global_batch": self.job.global_batch,
            "num_params": self.flat.size,
            **self.progress.summary(),
            "final_batches": list(plan.batches) if plan else [],
            "final_test_accuracy": acc,
            "final_test_loss": loss,
            "adjustments": self.planner.adjustments,
            "nonfinite_gradients": self.nonfinite,
            "diverged": self.losses.verdict is not None,
            "diverged_reason": (f"{self.losses.verdict.reason}; {self.losses.verdict.hint}"
                                if self.losses.verdict else None),
            "workers_lost": self.lost,
            "workers_left": self.left,
            "workers_joined": self.joined,
            "server_restores": self.restores,
            "resumed_from_step": self.resume.step if self.resume else None,
            "checkpoints": self.checkpoints.complete,
            "events_lost": self.run.events_lost,
        }
