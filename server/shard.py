"""One server's shard and its synchronisation rules, with no I/O (sans-IO core).

`ShardCore.handle(peer, msg, now)` takes a decoded message from a worker (or the
scheduler's evaluation pulls) and returns the replies to send. A refused message
gets an `Error` reply and leaves every piece of state as it was.

BSP: collect one push per worker for step t, apply g = sum(b_i g_i) / sum(b_i)
(summed in rank order, so runs are bit-for-bit repeatable), then answer all of
them with the new shard. ASP: apply each push on arrival with lr * b_i / b_ref
(divided by 1 + staleness with --staleness-lr inverse). SSP: as ASP, but the reply
to a worker's step s waits until s - (the slowest worker's last step) <= S.
Shard slots past the trained parameters hold model buffers (e.g. normalisation
statistics): they take the batch-weighted mean of the pushed values (BSP) or the
latest pushed values (ASP) and never see the optimizer.
"""

from dataclasses import dataclass

import numpy as np
import torch

from omnips import optim
from omnips.flat import aligned_zeros
from omnips.job import JobSpec
from omnips.protocol import Ack, Error, Init, Message, Params, Plan, Pull, Push


@dataclass(frozen=True)
class Outgoing:
    to: bytes
    msg: Message
    snapshot: bool = False  # send a copy of the data: the receiver may never read it (pulls)


MAX_WAITING_PULLS = 1024  # the scheduler keeps a few dozen evaluation pulls waiting


class ShardCore:
    def __init__(self, job: JobSpec, lo: int, hi: int, num_trained: int):
        self.job = job
        self.n = hi - lo
        self.trained = max(0, min(hi, num_trained) - lo)  # local slots [0, trained) are parameters
        self.values = aligned_zeros(self.n)
        self._agg = aligned_zeros(self.n) if job.mode == "bsp" else None
        self._opt = optim.make(job, torch.from_numpy(self.values[:self.trained]))
        self._b_ref = job.global_batch / job.num_workers
        self.version = 0
        self.initialized = False
        self.plan: Plan | None = None
        self._owner: dict[int, bytes] = {}  # rank -> the connection that speaks for it
        self._pending: dict[int, tuple[bytes, Push, float]] = {}  # BSP pushes for step `version`
        self._last_step: dict[int, int] = {}  # ASP/SSP: newest step applied per rank
        self._held: list[tuple[bytes, Push, float]] = []  # SSP replies waiting for the slowest worker
        self._pulls: list[tuple[bytes, Pull, float]] = []  # waiting for init or for `at`
        self.staleness_sum = 0
        self.staleness_max = 0
        self.updates = 0

    # -- entry point -------------------------------------------------------------
    def handle(self, peer: bytes, msg: Message, now: float) -> list[Outgoing]:
        if isinstance(msg, Push):
            return self._push(peer, msg, now)
        if isinstance(msg, Pull):
            return self._pull(peer, msg, now)
        if isinstance(msg, Init):
            return self._init(peer, msg, now)
        return [_error(peer, "bad_op", f"a server does not take {msg.OP!r} from workers")]

    def set_plan(self, plan: Plan, now: float) -> list[Outgoing]:
        if self.plan is None or plan.gen > self.plan.gen:
            self.plan = plan
        if plan.stop:  # the job is ending: nobody waits for the slowest any more
            held, self._held = self._held, []
            return [self._params(peer, p.step, now - t, p.gen) for peer, p, t in held]
        return []

    # -- ops ---------------------------------------------------------------------
    def _init(self, peer, msg: Init, now):
        if msg.rank != 0:
            return [_error(peer, "bad_rank", f"only worker 0 initialises shards, not worker {msg.rank}")]
        if self.initialized:
            return [_error(peer, "already_initialized", "this shard already holds values")]
        if msg.data.size != self.n:
            return [_error(peer, "bad_length", f"init carries {msg.data.size} values, shard holds {self.n}")]
        if not _finite(msg.data):
            return [_error(peer, "non_finite", "initial values contain NaN or inf")]
        refusal = self._claim(peer, msg.rank)
        if refusal:
            return [refusal]
        np.copyto(self.values, msg.data)
        self.initialized = True
        return [Outgoing(peer, Ack())] + self._release_pulls(now)

    def _pull(self, peer, msg: Pull, now):
        if self.initialized and (msg.at is None or msg.at == self.version):
            return [self._params(peer, msg.req, 0.0, None, snapshot=True)]
        if msg.at is not None and msg.at < self.version:
            return [_error(peer, "version_passed", f"pull at version {msg.at}, shard is at {self.version}")]
        if len(self._pulls) >= MAX_WAITING_PULLS:
            return [_error(peer, "busy", f"{MAX_WAITING_PULLS} pulls are already waiting")]
        self._pulls.append((peer, msg, now))
        return []

    def _push(self, peer, msg: Push, now):
        refusal = self._check_push(peer, msg)
        if refusal:
            return [refusal]
        self._claim(peer, msg.rank)
        if self.job.mode == "bsp":
            self._pending[msg.rank] = (peer, msg, now)
            if len(self._pending) < self.job.num_workers:
                return []
            return self._apply_bsp(now)
        return self._apply_asp(peer, msg, now) + self._release_pulls(now)

    def _check_push(self, peer, msg: Push) -> Outgoing | None:
        if not self.initialized:
            return _error(peer, "not_ready", "shard not initialised yet: pull first")
        if msg.rank >= self.job.num_workers:
            return _error(peer, "bad_rank", f"worker rank {msg.rank} outside 0..{self.job.num_workers - 1}")
        owner = self._owner.get(msg.rank)
        if owner is not None and owner != peer:
            return _error(peer, "rank_taken", f"worker rank {msg.rank} is bound to another connection")
        if msg.data.size != self.n:
            return _error(peer, "bad_length", f"push carries {msg.data.size} values, shard holds {self.n}")
        if msg.ver > self.version:
            return _error(peer, "bad_version", f"push computed on version {msg.ver}, shard is at {self.version}")
        if self.job.mode == "bsp":
            if msg.step != self.version:
                return _error(peer, "bad_step", f"push for step {msg.step}, shard is collecting step {self.version}")
            if msg.rank in self._pending:
                return _error(peer, "duplicate", f"worker {msg.rank} already pushed step {msg.step}")
        elif msg.step <= self._last_step.get(msg.rank, -1):
            return _error(peer, "duplicate", f"worker {msg.rank} already pushed step {msg.step}")
        if not _finite(msg.data):
            return _error(peer, "non_finite", f"gradient from worker {msg.rank} for step {msg.step} "
                                              "has NaN, inf or overflowing values")
        return None

    def _claim(self, peer, rank) -> Outgoing | None:
        owner = self._owner.setdefault(rank, peer)
        if owner != peer:
            return _error(peer, "rank_taken", f"worker rank {rank} is bound to another connection")
        return None

    # -- updates -----------------------------------------------------------------
    def _apply_bsp(self, now):
        pushes = [self._pending[r] for r in sorted(self._pending)]
        if len(pushes) == 1:  # weight 1: step on the pushed values, saving a pass over the shard
            self._step(pushes[0][1].data, self.job.lr)
        else:
            total = sum(p.batch for _, p, _ in pushes)
            np.multiply(pushes[0][1].data, pushes[0][1].batch / total, out=self._agg)
            agg = torch.from_numpy(self._agg)
            for _, p, _ in pushes[1:]:
                agg.add_(torch.from_numpy(p.data), alpha=p.batch / total)
            self._step(self._agg, self.job.lr)
        self.version += 1
        self.updates += 1
        self._pending.clear()
        replies = [self._params(peer, p.step, now - t, p.gen) for peer, p, t in pushes]
        return replies + self._release_pulls(now)

    def _apply_asp(self, peer, msg: Push, now):
        staleness = self.version - msg.ver
        lr = self.job.lr * msg.batch / self._b_ref
        if self.job.staleness_lr == "inverse":
            lr /= 1 + staleness
        self._step(msg.data, lr)
        self.version += 1
        self.updates += 1
        self._last_step[msg.rank] = msg.step
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        if self.job.mode == "asp":
            return [self._params(peer, msg.step, 0.0, msg.gen)]
        self._held.append((peer, msg, now))
        slowest = min(self._last_step.get(r, -1) for r in range(self.job.num_workers))
        ready = [h for h in self._held if h[1].step - slowest <= self.job.staleness]
        self._held = [h for h in self._held if h[1].step - slowest > self.job.staleness]
        return [self._params(p_peer, p.step, now - t, p.gen) for p_peer, p, t in ready]

    def _step(self, grad: np.ndarray, lr: float):
        """One optimizer step with `grad`; buffer slots simply take grad's values."""
        t = self.trained
        if t:
            self._opt.step(torch.from_numpy(grad[:t]), lr)
        np.copyto(self.values[t:], grad[t:])

    # -- replies -----------------------------------------------------------------
    def _params(self, peer, req, held_s, gen_seen, snapshot=False):
        plan = None
        if self.plan is not None and gen_seen is not None and gen_seen < self.plan.gen:
            plan = {"gen": self.plan.gen, "batches": self.plan.batches, "stop": self.plan.stop}
        return Outgoing(peer, Params(req=req, version=self.version, held_s=held_s, plan=plan, data=self.values),
                        snapshot)

    def _release_pulls(self, now):
        ready, waiting = [], []
        for entry in self._pulls:
            (ready if entry[1].at in (None, self.version) else waiting).append(entry)
        self._pulls = waiting
        return [self._params(peer, m.req, now - t, None, snapshot=True) for peer, m, t in ready]


def _finite(data: np.ndarray) -> bool:
    """True when every value is finite and the sum of squares does not overflow float32.

    One BLAS dot (4 ms for 44 MB here) instead of isfinite's temporary mask (65 ms).
    """
    return bool(np.isfinite(np.dot(data, data))) if data.size else True


def _error(peer, code, text) -> Outgoing:
    return Outgoing(peer, Error(code=code, text=text))
