"""The scheduler's pure core: events in, instructions out (scheduler/instructions.py).

Events: a message from a process (`handle(peer, msg, now)`: register, report, probe,
heartbeat, leave, failed, a server's restore answer), a server's reply on the sockets the
scheduler opened to them (`server_reply`: a shard read for an evaluation, a checkpoint
saved), an evaluation's result (`evaluated`), a stop asked by a signal (`request_stop`)
and the passing of time (`tick(now)`). Each returns what the driver (scheduler/service.py)
does, in order. No sockets and no clock of its own. The decisions live beside it:
registry.py (membership), planning.py (the plan), progress.py, evaluation.py,
liveness.py, recovery.py (a lost server), stopping.py; this module routes the events
between them.
"""

import logging
import math
from pathlib import Path

from omnips import protocol
from omnips.batching import BatchPlan
from omnips.checkpoint import Manifest
from omnips.job import JobSpec
from omnips.protocol import Ack, Failed, Heartbeat, Leave, Params, Plan, Probe, Register, Report, Saved, Shutdown

from .checkpoints import CheckpointBook
from .disturbance import Disturbances
from .divergence import LossWatch
from .evaluation import Evaluations, PendingEval
from .instructions import ConnectServers, Finish, Flush, JobFailed, Outbox
from .liveness import Liveness
from .options import SchedulerOptions
from .planning import Planner
from .progress import Progress
from .recovery import Recovery
from .registry import Member, Registry
from .reports import Reports
from .stalls import NOTICE_S, StallWatch
from .stopping import Stop, begin_or_save, on_leave, worker_silence_limit

log = logging.getLogger("omnips.scheduler")


class SchedulerCore:
    def __init__(self, job: JobSpec, opts: SchedulerOptions, num_params: int, num_trained: int, train_size: int,
                 checkpoints: str, resume: Manifest | None = None, fingerprints: dict | None = None,
                 chance_loss: float = math.inf):
        """`checkpoints`: the directory (absolute: servers elsewhere write there); `resume`:
        continue an interrupted run from this checkpoint; `chance_loss`: the training loss of
        predicting the label frequencies (scheduler/divergence.py; inf: not known)."""
        self.job, self.opts, self.resume = job, opts, resume
        self.out = Outbox()
        self.now = 0.0  # the time of the event being handled
        self.progress = Progress(job, train_size)
        if resume is not None:
            self.progress.resume(resume.worker_steps, resume.positions)
        self.registry = Registry(job, num_params, num_trained, self.progress.total_steps, opts.dead_after_s,
                                 opts.heartbeat_s, checkpoints, resume, opts.token)
        self.registry.fingerprints = fingerprints or {}
        self.planner = Planner(job, self.registry, self.out)
        self.stalls = StallWatch(job.mode, opts.heartbeat_s)  # which rank a stalled step waits for
        self.alive = Liveness(opts.heartbeat_s, opts.dead_after_s, opts.register_timeout_s, opts.stall_timeout_s,
                              opts.server_timeout_s)
        # with --checkpoint-every 0 too: a preemption writes one
        self.checkpoints = CheckpointBook(checkpoints, job, self.registry.ranges, opts.checkpoint_every,
                                          resume.step if resume else 0)
        self.evals = Evaluations(job, self.progress, self.out)
        self.recovery = Recovery(self)
        self.reports = Reports(self)
        self.losses = LossWatch(job, train_size, resumed=resume is not None, chance=chance_loss)
        self.disturbances = Disturbances()  # evaluations and checkpoint writes: steps then are not measured
        self.lost, self.left, self.joined = 0, 0, 0  # workers (left: a SIGTERM)
        self.stop_asked: str | None = None  # what asked for a stop (request_stop, a leave), until it is begun
        self.stop: Stop | None = None
        self.signalled = False  # this process got a signal (a second one ends the job at once)
        self._started = False

    # -- events -------------------------------------------------------------------
    def handle(self, peer: bytes, msg: protocol.Message, now: float) -> list:
        """A message from a process on the scheduler's router."""
        return self._run(now, self._on_message, peer, msg)

    def server_reply(self, server: int, msg: Params | Saved, now: float) -> list:
        """A server's answer to an evaluation pull or a checkpoint request."""
        return self._run(now, self.reports.on_saved if isinstance(msg, Saved) else self.evals.on_params, server, msg)

    def evaluated(self, e: PendingEval, acc: float, loss: float, start: float, now: float) -> list:
        """Evaluate(e) ran from `start` to `now`."""
        def done():
            self.disturbances.add(start, now)
            self.evals.evaluated(e, acc, loss)
            self.reports.diverged(self.losses.on_eval())
        return self._run(now, done)

    def checkpoint_unsent(self, request: int, step: int, error: str, now: float) -> list:
        """AskCheckpoint could not reach the servers."""
        def unsent():
            del self.checkpoints.pending[request]
            log.warning("checkpoint %d not taken: cannot ask the servers: %s", step, error)
            if self.stop is not None and self.stop.checkpoint_request == request:
                self.stop.checkpoint_request = None
        return self._run(now, unsent)

    def tick(self, now: float, unread: bool = False) -> list:
        """Time passed; `unread`: messages wait on the router (silences are not judged then)."""
        def tick():
            if self.stop_asked is not None or self.stop is not None:
                begin_or_save(self)
            self.beat()
            self._timeouts(unread)
            self._tell_waits()
        return self._run(now, tick)

    def heartbeats(self, now: float) -> list:
        """During a long evaluation: the heartbeats when due, nothing else."""
        return self._run(now, self.beat)

    def request_stop(self, why: str) -> bool:
        """A signal asks to preempt the job: the workers stop after their step in flight, the
        model and a checkpoint are written, then it ends. False: a signal asked already. A stop
        a server's or the last worker's leave began is the same stop (a batch system signals
        every process at once, and their leaves may arrive before the scheduler's own signal)."""
        if self.signalled:
            return False
        self.signalled = True
        if self.stop_asked is None and self.stop is None:
            self.stop_asked = why
        return True

    def ended(self, now: float) -> bool:
        if self.stop is None:  # a checkpoint in flight at the end is waited for: its shards are on disk
            return self.progress.all_done and self.evals.final is not None and not self.checkpoints.pending
        return (self.evals.final is not None and self.stop.saved) or now > self.stop.deadline

    def outcome(self) -> Finish:
        """How the job ends once ended() says so."""
        if self.stop is None:
            return Finish("completed")
        return Finish("interrupted" if self.stop.why == "SIGINT" else "preempted",  # Ctrl-C, or a batch system
                      self.stop.detail(self.progress.steps, model=self.evals.final is not None))

    def finish(self, status: str, stopped: str | None) -> list:
        """The job ends: every process is told, the end is written."""
        ok = status == "completed"
        said = f"{status}: {stopped}" if stopped else status
        (log.info if ok else log.warning if stopped else log.error)("job %s", said)
        for member in self.registry.by_peer.values():
            self.out.send(member.peer, Shutdown(ok=ok, reason=said, preempted=stopped is not None))
        self.out.event("end", status=status, stopped=stopped)
        return self.out.take()

    def _run(self, now: float, fn, *args) -> list:
        self.now = now
        try:
            fn(*args)
        except JobFailed as exc:
            self.out.append(Finish(f"failed: {exc}"))
        return self.out.take()

    # -- time -----------------------------------------------------------------------
    def beat(self) -> None:
        """Heartbeats to every member when due. A scheduler that sent nothing for longer than
        the processes wait for it was stalled: they have given up on it, and it ends the job
        saying so, rather than find them silent one by one --dead-after later."""
        if not self.alive.beat_due(self.now):
            return
        silent = self.alive.own_silence(self.now) if self.registry.complete else None  # until their welcome,
        if silent is not None:                                                         # processes wait 30 s
            raise JobFailed(f"the scheduler sent nothing for {silent:.0f} s (it was stalled: stopped, or starved of "
                            f"CPU), longer than --dead-after ({self.opts.dead_after_s:g} s), after which the "
                            "servers and workers give up on it" + self.recovery_hint())
        for member in self.registry.by_peer.values():
            self.out.send(member.peer, Heartbeat())
        self.alive.beaten(self.now)
        self.out.append(Flush())

    def _timeouts(self, unread: bool) -> None:
        if not self.registry.complete:
            self.alive.forming(self.now, self.registry.missing())
        elif self.progress.all_done:
            if self.alive.finishing(self.now):
                self.reports.end_overdue()
        elif self.alive.stalled(self.now, self.progress.last_report):
            raise JobFailed(f"no progress reported for {self.opts.stall_timeout_s:g} s" + self.recovery_hint())
        elif not unread:  # judge silences only with nothing unread
            self._silences()

    def _silences(self) -> None:
        """A worker silent for worker_silence_limit leaves the job; a silent server is replaced or fails it."""
        for m in self.registry.servers:
            silent = self.alive.silent(m.peer, self.now)
            if silent > self.opts.dead_after_s and m.rank not in self.registry.vacant_servers:
                self.recovery.server_lost(m, f"has been silent for {silent:.0f} s{self.alive.last_phase(m.peer)}")
        limit = worker_silence_limit(self)
        for rank, m in list(self.registry.workers.items()):
            silent = self.alive.silent(m.peer, self.now)
            if silent > limit and not self.progress.workers[rank].done:
                during = " during the stop" if self.stop else ""
                self.depart(rank, f"silent for {silent:.0f} s{during}{self.alive.last_phase(m.peer)}")

    def _tell_waits(self) -> None:
        """Say what a stalled job waits for: a lost server's replacement, or the rank a step waits for."""
        if self.recovery.notice(self.now):
            return
        told = self.stalls.notice(self.now)
        if told is not None:  # a wait of a few step times is news; one past NOTICE_S, a warning
            change, wait = told
            if change == "waits":
                (log.warning if wait.seconds >= NOTICE_S else log.info)("%s", wait)
            else:
                log.info("step %d went on after %.1f s", wait.step, wait.seconds)
            self.out.event("wait", change=change, **wait._asdict())

    def recovery_hint(self) -> str:
        """How the user can go on after a failure, if a checkpoint allows it."""
        if not self.checkpoints.complete:
            return ""
        return f"; start the processes again with --resume {Path(self.opts.run_dir)} on the scheduler"

    # -- messages -----------------------------------------------------------------
    def _on_message(self, peer: bytes, msg: protocol.Message) -> None:
        server = getattr(self.registry.by_peer.get(peer), "role", "") == "server"
        if isinstance(msg, Register):
            self._on_register(peer, msg)
        elif isinstance(msg, Report):
            self.reports.on_report(peer, msg)
        elif isinstance(msg, Probe):
            self.reports.on_probe(peer, msg)
        elif isinstance(msg, Ack) and server:
            self.recovery.restored(self.registry.by_peer[peer].rank)
        elif isinstance(msg, protocol.Error) and server:
            # a server that cannot take its shard back from a checkpoint: nothing to go on from
            raise JobFailed(f"{msg.code}: {msg.text}")
        elif isinstance(msg, Leave) and peer in self.registry.by_peer:
            self._on_leave(self.registry.by_peer[peer], msg.why)
        elif isinstance(msg, Heartbeat):
            if msg.echo and peer in self.registry.by_peer:  # at once: whatever we sent it before goes first
                self.out.send(peer, Heartbeat(echo=msg.echo))
            self._on_beat(peer, msg)
        elif isinstance(msg, Failed):
            self._on_failed(peer, msg)
        else:
            self.refuse(peer, "bad_op", f"the scheduler does not take {msg.OP!r}")
        if peer in self.registry.by_peer:  # registered (now): any word proves it alive
            self.alive.heard(peer, self.now)

    def refuse(self, peer: bytes, code: str, text: str) -> None:
        log.warning("refused a message: %s: %s", code, text)
        self.out.send(peer, protocol.Error(code=code, text=text))

    def _on_register(self, peer: bytes, msg: Register) -> None:
        if (msg.role == "server" and self.registry.complete and not self.registry.vacant_servers
                and self.registry.refusal(peer, msg) is None):  # another job's process removes nobody
            self.recovery.replace_silent_server()
        servers_before = len(self.registry.servers) == self.job.num_servers
        for to, out in self.registry.register(peer, msg):
            self.out.send(to, out)
            if isinstance(out, protocol.Error):
                log.warning("refused a registration: %s", out.text)
        member = self.registry.by_peer.get(peer)
        if member is not None and member.info is msg:
            log.info("%s registered from %s (pid %d)", msg.role, msg.host, msg.pid)
        if not servers_before and len(self.registry.servers) == self.job.num_servers:
            for server in self.registry.servers:  # ranks are final only now
                self.membership(server)
                self.stalls.servers[server.rank] = server.info.host
            self.connect_servers()
        if self.registry.complete and not self._started:
            self._started = True
            self.alive.complete_at = self.now
            for worker in self.registry.workers.values():  # ranks are final only now
                self.progress.seat(worker.rank, joined=False)
                self.stalls.seat(worker.rank, worker.info.host, worker.info.device, self.now)
                self.membership(worker)
            plan = self.planner.start(probe=self.job.probe and self.resume is None)  # a resumed job's workers go on
            for worker in self.registry.workers.values():
                self.out.send(worker.peer, self.registry.worker_welcome(worker, plan))
            log.info("cluster complete; batches %s", list(plan.batches))
            self.send_plan(plan)  # every server learns whom a step waits for
        for member in self.registry.joined:
            self._join(member)
        self.registry.joined.clear()
        for member in self.registry.reseated:  # takes a lost server's shard, from the checkpoint
            self.recovery.reseated(member)
        self.registry.reseated.clear()

    def connect_servers(self, reconnect: bool = False) -> None:
        self.out.append(ConnectServers(reconnect))
        self.evals.connected()
        if self.job.mode == "bsp":
            self.reports.bsp_checkpoints(self.progress.total_steps)

    def membership(self, m: Member, change: str = "joined", **more) -> None:
        i = m.info
        self.out.event("membership", change=change, role=m.role, rank=m.rank, host=i.host, pid=i.pid,
                       device=i.device, threads=i.threads, capacity=i.capacity, endpoint=i.endpoint, ipc=i.ipc,
                       **more)

    def _join(self, member: Member) -> None:
        """A worker took a vacant rank in the running job: a plan that gives it a share, then
        its welcome (BSP: it starts at the first step of that plan; ASP/SSP: at the slowest
        present worker's step, so that SSP's bound does not hold everyone back for it)."""
        steps = [w.next_step for w in self.progress.workers if w.present and w.next_step is not None]
        self.progress.seat(member.rank, joined=True)
        self.stalls.seat(member.rank, member.info.host, member.info.device, self.now)
        plan = self._membership_plan(sorted(self.registry.workers), "joined")
        self.send_plan(plan)
        self.out.send(member.peer,
                      self.registry.worker_welcome(member, plan, join_gen=plan.gen, start_step=min(steps, default=0)))
        self.joined += 1
        self.membership(member, "joined", late=True)
        log.info("worker %d joined from %s: batches %s", member.rank, member.info.host, list(plan.batches))

    def depart(self, rank: int, why: str, change: str = "lost") -> None:
        """Worker `rank` is gone (lost, or left): servers stop waiting for its later steps and
        the others share its part of the global batch from the next plan on."""
        w = self.progress.workers[rank]
        last = w.next_step - 1 if w.next_step is not None else -1
        member = self.registry.depart(rank)
        self.progress.depart(rank)
        self.alive.forget(member.peer)
        self.out.send(member.peer, Shutdown(ok=False, reason=f"removed from the job: {why}"))
        if change == "lost":
            self.lost += 1
        else:
            self.left += 1
        self.stalls.leave(rank)
        self.membership(member, change, reason=why, last_step=last)
        log.warning("worker %d %s (%s) after step %d", rank, change, why, last)
        if not self.registry.workers:
            self.recovery.no_workers(rank, why)  # they gave up on a lost server, not the reverse
            raise JobFailed(f"every worker is gone (the last, worker {rank}: {why})")
        plan = self.planner.plan
        if not plan.stop:
            plan = self._membership_plan(sorted(self.registry.workers), "lost")
        self.send_plan(plan, departed=[(rank, last)])
        self.evals.final_if_done()
        self.start_plan(self.planned(self.planner.departed, rank))

    def _membership_plan(self, active: list[int], change: str) -> BatchPlan:
        return self.planned(self.planner.membership, active, change, self.progress.reached)

    def planned(self, decide, *args) -> BatchPlan | None:
        """decide(*args), a Planner's decision; a plan the workers cannot run fails the job."""
        try:
            return decide(*args)
        except ValueError as exc:
            raise JobFailed(str(exc)) from None

    def start_plan(self, plan: BatchPlan | None) -> None:
        """The first step's plan (None: probes still awaited), to the servers and every worker."""
        if plan is None:
            return
        self.send_plan(plan)
        for m in self.registry.workers.values():
            self.out.send(m.peer, Plan(plan=plan))

    def send_plan(self, plan: BatchPlan, departed=()) -> None:
        """Every server hands the plan on with its replies; a worker takes the newest it
        gets in a step's replies, which every BSP worker gets alike: all switch at one step."""
        self.planner.set(plan)
        for m in self.registry.servers:
            self.out.send(m.peer, Plan(plan=plan, departed=tuple(departed)))

    def _on_leave(self, m: Member, why: str) -> None:
        """A process's SIGTERM (stopping.on_leave): a worker has left after its step in flight;
        a server's, or the last worker's, preempts the job."""
        if m.role == "worker" and not (m.rank in self.registry.workers and self.progress.workers[m.rank].present):
            return  # not ranked yet, or already gone
        who = f"{why} to {m.role} {m.rank} on {m.info.host}"
        stopping = self.stop_asked is not None or self.stop is not None
        others = sum(w.present for r, w in enumerate(self.progress.workers) if r != m.rank)
        action = on_leave(m.role, stopping, others)
        if action == "depart":
            self.depart(m.rank, who, change="left")
            return
        if m.role == "worker":  # it has stopped after its step in flight: no step waits for it
            self.progress.workers[m.rank].done = True
        if not stopping:
            self.stop_asked = who

    def _on_beat(self, peer: bytes, msg: Heartbeat) -> None:
        member = self.registry.by_peer.get(peer)
        if member is None:
            return
        self.alive.on_beat(peer, msg.phase)
        if member.role == "worker" and member.rank in self.registry.workers:
            self.stalls.on_beat(member.rank, msg.step, msg.waited_s, msg.servers, self.now)
        elif member.role == "server":
            self.stalls.on_server_beat(member.rank, self.now)

    def _on_failed(self, peer: bytes, msg: Failed) -> None:
        """A process's last word before it exits: act on it now rather than on its silence."""
        member = self.registry.by_peer.get(peer)
        if member is None:  # gone already, or never in the job: nothing waits for it
            log.info("%s exits: %s", self.registry.describe(peer), msg.reason)
        elif member.role == "worker" and member.rank in self.registry.workers:
            self.depart(member.rank, f"failed: {msg.reason}")
        elif member.role == "server" and self.registry.complete:
            self.recovery.server_lost(member, f"failed: {msg.reason}")
        else:  # a server before the job started
            raise JobFailed(f"{member} failed: {msg.reason}")
