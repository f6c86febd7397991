"""The scheduler process's driver: its sockets (the router every process talks to, a
dealer to each server for evaluations and checkpoints), the run directory and the status
server, the loop that polls them, and the evaluations themselves (torch). Every decision
is the pure core's (scheduler/core.py): this module turns bytes and time into its events
and carries out the instructions it returns (scheduler/instructions.py).
"""

import logging
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from omnips import codec, data, fingerprint, models, protocol, routes, security, transport
from omnips.checkpoint import Manifest, set_aside_after
from omnips.flat import FlatModel
from omnips.job import PREEMPTED_EXIT, JobSpec
from omnips.metrics import RunDir, atomic_file
from omnips.protocol import Params, ProtocolError, Register, Saved
from omnips.servers import ServerError, ServerGroup

from .core import SchedulerCore
from .evaluation import PendingEval
from .instructions import (AskCheckpoint, AskEval, ConnectServers, Evaluate, Finish, Flush, JobFailed, Send,
                           WriteEvent, WriteStep)
from .options import SchedulerOptions
from .status_server import NoStatus, open_status

__all__ = ["JobFailed", "Scheduler", "SchedulerOptions"]

log = logging.getLogger("omnips.scheduler")

POLL_MS = 100
ROUTER_BURST = 1000  # messages read from the router per loop turn, at most


class Ended(Exception):
    """A Finish instruction: the loop ends with it."""

    def __init__(self, finish: Finish):
        super().__init__(finish.status)
        self.finish = finish


class Scheduler:
    def __init__(self, job: JobSpec, opts: SchedulerOptions, announce=print, resume: Manifest | None = None):
        """`resume`: continue the interrupted run in opts.run_dir from this checkpoint."""
        self.job, self.opts = job, opts
        self.announce = announce
        train, test = data.load(job.dataset, job.dataset_args)
        self.flat = FlatModel(models.build(job.model, job.model_args, train, job.seed))
        self.test_batcher, self.test_size = data.Batcher(test), len(test)
        checkpoints = Path(opts.run_dir).resolve() / "checkpoints"  # absolute: servers elsewhere write there
        self.core = SchedulerCore(job, opts, self.flat.size, self.flat.num_trained, len(train), str(checkpoints),
                                  resume, {"model": fingerprint.model(self.flat.module),
                                           "data": fingerprint.data(train, test)}, models.chance_loss(train))
        self.resume = resume
        self.servers: ServerGroup | None = None
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
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)

    # -- lifecycle ----------------------------------------------------------------
    def serve(self) -> int:
        progress = self.core.progress
        try:
            self.status.announce(self.announce)  # first: a launcher reads up to the address
            self.announce(f"omnips scheduler listening on {self.endpoint}", flush=True)
            if self.resume is not None:
                self.run.event("resume", step=self.resume.step, checkpoint=str(self.resume.path))
                log.info("resuming from checkpoint %s (step %d)", self.resume.path, self.resume.step)
            self.run.event("start", endpoint=self.endpoint, clock_t0=self.run.t0, num_params=self.flat.size,
                           train_size=progress.train_size, test_size=self.test_size, budget_samples=progress.budget,
                           budget_epochs=progress.budget / progress.train_size)
            log.info("job: %s, %d server(s), %d worker(s), %d parameters, run dir %s", self.job.mode,
                     self.job.num_servers, self.job.num_workers, self.flat.size, self.run.path)
            log.info("connections: %s; %s", security.describe(self.opts.keys),
                     "a job token is required" if self.opts.token else "no job token")
            self._warm_up()
            self._loop()
        except Ended as end:
            return self._finish(end.finish)
        except (ServerError, transport.TransportError) as exc:
            return self._finish(Finish(f"failed: {exc}"))
        except KeyboardInterrupt:
            return self._finish(Finish("failed: interrupted"))
        return self._finish(self.core.outcome())

    def request_stop(self, why: str) -> None:
        """From a signal handler: preempt the job at the next loop turn, writing the model and
        a checkpoint first; a second signal ends it at once."""
        if not self.core.request_stop(why):
            raise KeyboardInterrupt

    def _finish(self, end: Finish) -> int:
        """`end.stopped`: what a stop asked by a signal saved (the job can be resumed)."""
        status, stopped = end.status, end.stopped
        ok = status == "completed"
        for instruction in self.core.finish(status, stopped):
            self._do(instruction)
        self.run.flush()
        try:
            self.run.write_summary({**self._summary(status), "stopped": stopped})
        except OSError as exc:
            log.error("cannot write the summary of the job (%s): %s", f"{status}: {stopped}" if stopped else status,
                      exc)
            ok, stopped = False, None
        self.run.close()
        self._close(linger=transport.LINGER_MS)
        return 0 if ok else PREEMPTED_EXIT if stopped else 1

    def _close(self, linger: int) -> None:
        self.status.close()
        if self.gate is not None:
            self.gate.stop()
        self.ctx.destroy(linger=linger)

    def _loop(self) -> None:
        now = time.monotonic()
        while not self.core.ended(now):
            events = dict(self.poller.poll(POLL_MS))
            now = time.monotonic()
            if self.router in events:
                for _ in range(ROUTER_BURST):  # all that waits: a lagging loop would misjudge silences
                    self.receive()
                    if not self.router.poll(0):
                        break
            if self.servers is not None:
                for s, sock in enumerate(self.servers.socks):
                    if sock in events:
                        self._on_server(s, transport.recv_frames(sock))
            self.execute(self.core.tick(now, unread=bool(self.router.poll(0))))
            self.status.tick(now)

    # -- bytes in -----------------------------------------------------------------
    def receive(self) -> None:
        """One message from the router, to the core (a bad one is refused here, in a line)."""
        peer, *frames = transport.recv_frames(self.router)
        peer = peer.bytes
        try:
            msg = codec.decode(frames)
        except ProtocolError as exc:
            log.warning("refused a message: %s", exc)
            self._send(peer, protocol.Error(code=exc.code, text=exc.text))
            return
        now = time.monotonic()
        if isinstance(msg, Register) and msg.role == "server" and not self._job_key(frames[0]):
            self.core.refuse(peer, "bad_key", "a server registers with the key directory 'omnips keygen' made, "
                                              "not with one machine's client key (--client): it holds no server secret")
            self.execute(self.core.out.take())
            return
        self.execute(self.core.handle(peer, msg, now))

    def _job_key(self, frame) -> bool:
        """With --keys, whether the peer connected with the job's own client key (the gate
        names each connection by its key); without, anyone may."""
        return self.opts.keys is None or frame.get("User-Id") == self.opts.keys.client_public.decode()

    def _on_server(self, s: int, frames: list) -> None:
        try:
            msg = self.servers.decode_reply(s, frames)
        except ServerError as exc:
            log.warning("a server refused a request: %s", exc)
            return
        if isinstance(msg, Params):
            self.servers.accept(s, msg, None)
        if isinstance(msg, (Params, Saved)):
            self.execute(self.core.server_reply(s, msg, time.monotonic()))

    # -- instructions out ------------------------------------------------------------
    def execute(self, instructions: list) -> None:
        for instruction in instructions:
            self._do(instruction)

    def _do(self, i) -> None:
        if isinstance(i, Send):
            self._send(i.to, i.msg)
        elif isinstance(i, WriteEvent):
            self.run.event(i.kind, **i.fields)
        elif isinstance(i, WriteStep):
            self.run.step(i.report, i.epoch, i.disturbed)
        elif isinstance(i, Flush):
            self.run.flush()
        elif isinstance(i, AskEval):
            try:
                self.servers.send_pull(i.request, i.at)
            except zmq.ZMQError as exc:
                raise Ended(Finish(f"failed: cannot ask the servers for an evaluation: {exc}")) from None
        elif isinstance(i, AskCheckpoint):
            try:
                self.servers.broadcast(i.msg)
            except zmq.ZMQError as exc:
                self.execute(self.core.checkpoint_unsent(i.msg.request, i.msg.step, str(exc), time.monotonic()))
        elif isinstance(i, Evaluate):
            self._evaluate(i.pending)
        elif isinstance(i, ConnectServers):
            self._connect_servers(i.reconnect)
        elif isinstance(i, Finish):
            raise Ended(i)
        else:
            raise TypeError(f"not an instruction: {i!r}")

    def _send(self, peer: bytes, msg: protocol.Message) -> None:
        transport.reply(self.router, peer, msg, name=lambda: self.core.registry.describe(peer))

    def _connect_servers(self, reconnect: bool) -> None:
        if reconnect:  # what was asked on the old sockets died with the rewind
            for sock in self.servers.socks:
                self.poller.unregister(sock)
            self.servers.close()
        registry = self.core.registry
        endpoints = routes.endpoints(registry.endpoints(), registry.local_endpoints(), self.opts.transport)
        self.servers = ServerGroup(self.ctx, endpoints, registry.ranges, self.opts.server_timeout_s,
                                   keys=self.opts.keys)
        for sock in self.servers.socks:
            self.poller.register(sock, zmq.POLLIN)

    def _warm_up(self) -> None:
        """One batch of an evaluation while the cluster forms: a process's first forward pass
        pays for its memory and its kernels (under the cgroup benchmark's load, 0.5 s of CPU
        against 0.15 later, and over 2 s of wall time with two other jobs' schedulers), and
        during the first evaluation no heartbeat goes out before that batch ends: every worker
        held its step for want of one."""
        models.evaluate(self.flat.module, self.test_batcher, min(self.test_size, models.EVAL_BATCH))

    def _evaluate(self, e: PendingEval) -> None:
        start = time.monotonic()
        for s, msg in e.shards.items():
            lo, hi = self.core.registry.ranges[s]
            np.copyto(self.flat.params[lo:hi], msg.data)
        self.flat.load_params()
        if e.final:  # first: a stop's deadline may come during the evaluation
            self._export_model()
        acc, loss = models.evaluate(self.flat.module, self.test_batcher, self.test_size,
                                    tick=lambda: self.execute(self.core.heartbeats(time.monotonic())))
        self.execute(self.core.evaluated(e, acc, loss, start, time.monotonic()))

    def _export_model(self) -> None:
        path = Path(self.run.path) / "model.pt"
        try:
            with atomic_file(path, "wb") as f:
                torch.save(self.flat.module.state_dict(), f)
        except OSError as exc:
            raise Ended(Finish(f"failed: cannot write {path}: {exc}")) from None

    # -- outputs ------------------------------------------------------------------
    def _summary(self, status: str) -> dict:
        core = self.core
        plan = core.planner.plan
        acc, loss = core.evals.final or (None, None)
        verdict = core.losses.verdict
        return {
            "status": status,
            "mode": self.job.mode,
            "batching": self.job.batching,
            "num_workers": self.job.num_workers,
            "num_servers": self.job.num_servers,
            "global_batch": self.job.global_batch,
            "num_params": self.flat.size,
            **core.progress.summary(),
            "final_batches": list(plan.batches) if plan else [],
            "final_test_accuracy": acc,
            "final_test_loss": loss,
            "adjustments": core.planner.adjustments,
            "nonfinite_gradients": core.reports.nonfinite,
            "diverged": verdict is not None,
            "diverged_reason": f"{verdict.reason}; {verdict.hint}" if verdict else None,
            "workers_lost": core.lost,
            "workers_left": core.left,
            "workers_joined": core.joined,
            "server_restores": core.recovery.restores,
            "resumed_from_step": self.resume.step if self.resume else None,
            "checkpoints": core.checkpoints.complete,
            "events_lost": self.run.events_lost,
        }
