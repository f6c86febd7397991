"""A job whose scheduler and servers run as processes and whose only worker is the
calling benchmark: it registers as a real worker would, and times round trips itself."""

import os
import socket as pysocket
import time
from pathlib import Path

import zmq

from omnips import routes
from omnips.launch import LocalCluster
from omnips.link import SchedulerLink
from omnips.protocol import Register, Report, Shutdown
from omnips.security import Keys
from omnips.servers import FLOAT32, Exchange, ServerGroup
from omnips.wire import WireDtype

REPLY_TIMEOUT_S = 60.0
SHUTDOWN_S = 60.0


class SoloWorker:
    def __init__(self, ctx: zmq.Context, run_dir: Path, scheduler_args: list[str], num_servers: int,
                 server_args: list[str], keys: Path | None = None, transport: str = "auto",
                 wire: WireDtype = FLOAT32):
        self.ctx, self.transport, self.wire = ctx, transport, wire
        self.cluster = LocalCluster(run_dir, scheduler_args, num_servers, [], server_args=server_args, keys=keys,
                                    ranks=1)
        self.keys = Keys.load(keys, listens=False) if keys else None
        self.steps = 0
        self.link: SchedulerLink | None = None

    def start(self, num_params: int) -> ServerGroup:
        """Start the scheduler and the servers, register, and connect to the servers (over
        ipc when `transport` allows it; the scheduler's model must have `num_params` values)."""
        self.cluster.start_scheduler(120.0)
        self.cluster.start_servers()
        self.link = SchedulerLink(self.ctx, self.cluster.endpoint, keys=self.keys)
        welcome = self.link.register(Register(role="worker", host=pysocket.gethostname(), threads=1,
                                              pid=os.getpid()), ack_timeout_s=10.0, welcome_timeout_s=120.0)
        info = welcome.cluster
        self.link.dead_after_s = info.dead_after_s
        if info.num_params != num_params:
            raise RuntimeError(f"the job has {info.num_params} values, expected {num_params}")
        endpoints = routes.endpoints(info.servers, info.ipc, self.transport)
        self.group = ServerGroup(self.ctx, endpoints, info.ranges, REPLY_TIMEOUT_S, on_wait=self._check_children,
                                 keys=self.keys, wire=self.wire)
        return self.group

    def _check_children(self) -> None:
        """While waiting for servers: fail fast if a process of the job died."""
        dead = {name: code for name, code in self.cluster.exit_codes().items() if code is not None}
        if dead:
            raise RuntimeError(f"cluster process(es) exited early: {dead}")

    def report(self, ex: Exchange) -> None:
        """Report the step just done, as a worker does, and read what the scheduler sent."""
        if ex.plan is not None and ex.plan.stop:
            raise RuntimeError("the scheduler stopped the job early")
        self.link.send(Report(rank=0, step=self.steps, batch=1, compute_s=0.0, wait_s=ex.held_s, loss=0.0,
                              network_s=max(0.0, ex.elapsed_s - ex.held_s)))
        self.steps += 1
        while self.link.sock.poll(0):  # heartbeats; a failed job ends in a Shutdown
            if isinstance(self.link.receive(), Shutdown):
                raise RuntimeError("the scheduler ended the job early")
        self.link.check_alive()

    def finish(self) -> None:
        """Say this worker is done, wait for the job's end, and check every process exited cleanly."""
        self.link.send(Report(rank=0, step=self.steps, batch=0, compute_s=0.0, network_s=0.0, wait_s=0.0,
                              loss=0.0, done=True))
        deadline = time.monotonic() + SHUTDOWN_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("the scheduler did not shut the job down")
            if self.link.sock.poll(int(left * 1000)) and isinstance(self.link.receive(), Shutdown):
                break
        self.link.close()
        self.cluster.stop(grace_s=15.0)
        codes = self.cluster.exit_codes()
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"cluster processes exited with {codes} (logs in {self.cluster.run_dir / 'logs'})")

    def stop(self) -> None:
        """Before the context ends, on every way out: the link's thread owns a socket of it."""
        if self.link is not None:
            self.link.close()  # (a second call does nothing)
        self.cluster.stop(grace_s=0.0)  # no-op when everything already exited
