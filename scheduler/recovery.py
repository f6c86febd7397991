"""A lost server: with a complete checkpoint, every server goes back to it, the lost one's
shard on whichever server registers next, and once every server says it is back the
workers rewind to it; without one, the job fails. Part of the scheduler's pure core
(scheduler/core.py): it appends what to tell whom to the core's Outbox."""

import logging
from dataclasses import dataclass

from omnips.batching import BatchPlan
from omnips.checkpoint import Manifest, newest_complete
from omnips.protocol import Restore, Rewind, Shutdown

from .instructions import JobFailed
from .registry import Member
from .stalls import NOTICE_S

log = logging.getLogger("omnips.scheduler")


@dataclass
class Lost:
    """A server was lost: the servers go back to `checkpoint`; `waiting` have not said so yet."""

    checkpoint: Manifest
    waiting: set[int]
    reached: int  # the furthest step reported before the loss
    lost: str  # which server was lost, and why, in words
    since: float  # when
    told_at: float  # when the log last said what the job waits for


class Recovery:
    def __init__(self, core):
        self.core = core  # the SchedulerCore this is part of
        self.lost: Lost | None = None
        self.restores = 0  # times a lost server's shard was taken over and the job went back

    def server_lost(self, m: Member, why: str) -> None:
        core = self.core
        ckpt = None
        if self.lost is None:
            ckpt, _ = newest_complete(core.checkpoints.root)
        if ckpt is None:
            raise JobFailed(f"server {m.rank} at {m.info.endpoint} {why}" + core.recovery_hint())
        # a server only frozen reads this when it wakes, and ends instead of serving the workers
        core.out.send(m.peer, Shutdown(ok=False, reason=f"removed from the job: server {m.rank} {why}"))
        core.registry.vacate_server(m.rank)
        core.alive.forget(m.peer)
        self.lost = Lost(ckpt, set(range(core.job.num_servers)), core.progress.reached,
                         f"server {m.rank} on {m.info.host} ({why})", core.now, core.now)
        for other in core.registry.servers:
            if other.rank != m.rank:
                core.out.send(other.peer, Restore(path=str(ckpt.path)))
        core.membership(m, "lost", reason=why)
        log.warning("server %d lost (%s): start a server again; the job goes back to step %d", m.rank, why, ckpt.step)

    def replace_silent_server(self) -> None:
        """A server registers while every shard has one: one that has missed two heartbeats
        is taken for lost now rather than after --dead-after (a supervisor restarting a
        crashed server need not wait); with all of them alive the newcomer is refused."""
        core = self.core
        for m in core.registry.servers:
            silent = core.alive.silent(m.peer, core.now)
            if silent > 2 * core.opts.heartbeat_s:
                self.server_lost(m, f"silent for {silent:.1f} s when a new server registered")
                return

    def reseated(self, m: Member) -> None:
        """A server took the lost one's shard: it starts from the checkpoint."""
        core = self.core
        core.stalls.servers[m.rank] = m.info.host
        core.out.send(m.peer, core.registry.server_welcome(m, restore=str(self.lost.checkpoint.path)))
        core.membership(m, "joined", late=True)

    def restored(self, rank: int) -> None:
        """A server is back at the checkpoint; once all are, the workers go back too."""
        if self.lost is None:
            return  # restored at its welcome when the job was resumed
        self.lost.waiting.discard(rank)
        if self.lost.waiting:
            return
        core = self.core
        ckpt, reached = self.lost.checkpoint, self.lost.reached
        self.lost = None
        core.progress.resume(ckpt.worker_steps, ckpt.positions)
        core.checkpoints.rewind(ckpt.step)
        core.connect_servers(reconnect=True)  # evaluation and checkpoint requests died with the rewind
        plan = BatchPlan(core.planner.plan.gen + 1, core.planner.plan.batches)
        core.send_plan(plan)
        rewind = Rewind(steps=list(ckpt.worker_steps), positions=list(ckpt.positions), plan=plan,
                        servers=core.registry.endpoints(), ipc=core.registry.local_endpoints())
        for w in core.registry.workers.values():
            core.out.send(w.peer, rewind)
            core.stalls.seat(w.rank, w.info.host, w.info.device, core.now)  # their steps start again
        self.restores += 1
        core.out.event("rewind", step=ckpt.step, worker_steps=list(ckpt.worker_steps),
                       steps_lost=max(0, reached - max(ckpt.worker_steps)), checkpoint=str(ckpt.path))
        log.info("every server is back at checkpoint %d: the workers go on from steps %s", ckpt.step,
                 list(ckpt.worker_steps))

    def no_workers(self, rank: int, why: str) -> None:
        """The last worker left during a recovery: it gave up on the lost server, not the reverse."""
        rec, core = self.lost, self.core
        if rec is not None:
            missing = "no server took its shard" if core.registry.vacant_servers else "the servers did not restore"
            raise JobFailed(f"{rec.lost} was lost {core.now - rec.since:.0f} s ago and {missing}: every "
                            f"worker gave up waiting (the last, worker {rank}: {why})" + core.recovery_hint())

    def notice(self, now: float) -> bool:
        """During a recovery, say every NOTICE_S what the job waits for; False when none is under way."""
        rec = self.lost
        if rec is None:
            return False
        if now - rec.told_at >= NOTICE_S:
            rec.told_at = now
            what = (f"a server to take the shard of {rec.lost}: start one with the server's command line; the "
                    "workers give up after their --server-timeout" if self.core.registry.vacant_servers else
                    f"servers {sorted(rec.waiting)} to restore checkpoint {rec.checkpoint.step}")
            log.warning("the job waits for %s (%.0f s since the loss)", what, now - rec.since)
        return True
