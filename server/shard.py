"""One server's shard and its synchronisation rules, with no I/O (sans-IO core).

`ShardCore.handle(peer, msg, now)` takes a decoded message from a worker (or the
scheduler's evaluation pulls) and returns the replies to send. A refused message
gets an `Error` reply and leaves every piece of state as it was.

BSP: collect one push per worker for step t, apply g = sum(b_i g_i) / sum(b_i)
(summed in rank order, so runs are bit-for-bit repeatable), then answer all of
them with the new shard. ASP: apply each push on arrival, corrected for its staleness
(server/asynchrony.py; with --staleness-lr inverse its learning rate is also divided
by 1 + staleness). SSP: as ASP, but the reply
to a worker's step s waits until s - (the slowest worker's last step) <= S.
Shard slots past the trained parameters hold model buffers (e.g. normalisation
statistics): they take the batch-weighted mean of the pushed values (BSP) or the
latest pushed values (ASP) and never see the optimizer.
With --wire-dtype bfloat16 or float16, a push is widened into a float32 buffer of its
rank's (so the BSP sum stays in rank order) and checked for finiteness there; replies
to pushes carry the shard narrowed into one buffer, once per version. Init, pulls and
checkpoints stay float32: they set or save state, which must not lose precision.
A step's bookkeeping (versions, counters, the optimizer's scalars) is done when it is
taken; with `lazy`, its values are written range by range by `ready(hi)`, which the
server calls before it sends each part of a reply, so the first parts leave while the
rest of the shard is still being updated (without `lazy`, before handle() returns).
A push may come in parts (buckets a worker sends while its backward pass runs):
server/assembly.py joins them (in the wire dtype), and the core sees one push whose
values are the parts as received, (offset, values) segments re-cut at aligned places
(server/segments.py) so that applying them is bit-for-bit applying the whole.
A `checkpoint` request is served like a pull (at once, or when the version reaches
`at`): the core answers with a `Snapshot` instruction holding a copy of its
state, which the server writes; `restore` takes such a state back.
"""

import bisect
import math
import weakref
from dataclasses import dataclass, replace

import numpy as np
import torch

from omnips import optim
from omnips.flat import aligned_empty, aligned_zeros, all_finite
from omnips.job import JobSpec, same_job
from omnips.protocol import MAX_PARTS, Ack, Checkpoint, Error, Init, Message, Params, Plan, Pull, Push, Saved
from omnips.wire import WireDtype, name_of

from . import asynchrony
from .assembly import Assembler, PartRefused
from .segments import ALIGN, aligned


@dataclass(frozen=True)
class Outgoing:
    to: bytes
    msg: Message
    snapshot: bool = False  # the data is a frozen() copy (pulls: the receiver may never read): sent untracked
    part: int = 0  # send Params in parts of this many values, the first ones first (0: whole)


@dataclass(frozen=True)
class ShardState:
    """What a shard's next updates depend on, as copies. Pushes waiting at a barrier are
    not part of it: after a restore their workers push them again."""

    meta: dict  # JSON-able: the job, sizes, version, counters, last step per rank, optimizer scalars,
    # the asynchronous correction's staleness record
    arrays: dict[str, np.ndarray]  # "values", and the optimizer's buffers as "opt.<name>"


@dataclass(frozen=True)
class Snapshot:
    """An instruction to the server: write `state` as checkpoint `step`, then answer `to`."""

    to: bytes
    req: int
    step: int
    state: ShardState


@dataclass
class _Due:
    """A step taken whose values are not all written yet."""

    grads: list  # (weight, segments sorted by offset, their offsets): the gradient is the weighted sum, in order
    rank: int = -1  # ASP/SSP: the worker whose push it applies
    done: int = 0  # values [0, done) hold the step
    narrow: bool = False  # a reply carries the step in the wire dtype: narrow each range too


MAX_WAITING_PULLS = 1024  # the scheduler keeps a few dozen evaluation pulls waiting
MAX_AHEAD = 1 << 40  # versions no job reaches: a thousand updates a second for 35 years
_NO_VALUES = np.empty(0, np.float32)


class ShardCore:
    def __init__(self, job: JobSpec, lo: int, hi: int, num_trained: int):
        self.job = job
        self.n = hi - lo
        self.trained = max(0, min(hi, num_trained) - lo)  # local slots [0, trained) are parameters
        self.values = aligned_zeros(self.n)
        self._agg = aligned_zeros(self.n) if job.mode == "bsp" else None
        self._opt = optim.make(job, torch.from_numpy(self.values[:self.trained]))
        self._async = asynchrony.make(job.async_correction if job.mode != "bsp" else "none", self.trained)
        self.wire = WireDtype(job.wire_dtype)
        self._widened: dict[int, np.ndarray] = {}  # float32 buffers for narrow pushes, one per BSP rank
        self._wire_values = self.wire.buffer(self.n)  # the shard narrowed for push replies (None: float32)
        self._wire_version: int | None = None  # the version _wire_values holds
        self._due: _Due | None = None  # the step taken whose values ready() still writes
        self._b_ref = job.global_batch / job.num_workers
        self.version = 0
        self.initialized = False
        self.plan: Plan | None = None  # the newest, handed on with replies
        # gen -> batches: who a BSP step waits for; every rank until the scheduler's first plan says otherwise
        self._plans: dict[int, tuple[int, ...]] = {0: (1,) * job.num_workers}
        self._gone: dict[int, tuple[int, float]] = {}  # rank -> (its last step, the gen that re-filled it)
        self._joiners: set[int] = set()  # ranks (re)activated that have not pushed yet
        self._owner: dict[int, bytes] = {}  # rank -> the connection that speaks for it
        self._pending: dict[int, tuple[bytes, Push, float, list]] = {}  # BSP pushes for step `version`, with
        # their values as (offset, values) segments
        self._pending_gen: int | None = None  # the plan those pushes were computed under
        self._gen_pulls: list[tuple[bytes, Pull, float]] = []  # joiners waiting for their first step
        self._last_step: dict[int, int] = {}  # ASP/SSP: newest step applied per rank
        self._held: list[tuple[bytes, Push, float]] = []  # SSP replies waiting for the slowest worker
        self._pulls: list[tuple[bytes, Pull, float]] = []  # waiting for init or for `at`
        self._parts = Assembler(self.n, max_open=2 * job.num_workers, check=self.wire.exact)  # pushes sent in buckets
        self.staleness_sum = 0
        self.staleness_max = 0
        self.updates = 0
        self.replies_in_parts = 0
        self.detached = 0  # times the shard moved to fresh buffers, its old ones left to queued replies
        self._writes = 0  # changes of the values: a frozen copy holds the values of one
        self._frozen: tuple[int, weakref.ref] | None = None  # (writes, the copy) while a reply holds it

    # -- entry point -------------------------------------------------------------
    def handle(self, peer: bytes, msg: Message, now: float, lazy: bool = False) -> list[Outgoing | Snapshot]:
        """The replies to `msg`. `lazy`: the values a step it completes writes are left to
        ready(), which must be called before anything is read from them."""
        return self._settled(lazy, self._handle, peer, msg, now)

    def _settled(self, lazy: bool, take, *args) -> list:
        """take(*args) on a shard whose last step is written whole; the step it takes is
        written before this returns, or with `lazy` left to ready()."""
        self.ready(self.n)
        out = take(*args)
        if not lazy:
            self.ready(self.n)
        return out

    def _handle(self, peer: bytes, msg: Message, now: float) -> list[Outgoing | Snapshot]:
        if isinstance(msg, Push):
            if not msg.whole:
                return self._push(peer, msg, now)
            refusal = self._check_fields(peer, msg)  # a bogus part would hold a place in assembly
            if refusal:
                return [refusal]
            try:
                joined = self._parts.feed(peer, msg)
            except PartRefused as exc:
                return [_error(peer, exc.code, exc.text)]
            return [] if joined is None else self._push(peer, joined.push, now, joined.segments, joined.finite)
        if isinstance(msg, (Pull, Checkpoint)):
            return self._pull(peer, msg, now)
        if isinstance(msg, Init):
            return self._init(peer, msg, now)
        return [_error(peer, "bad_op", f"a server does not take {msg.OP!r} from workers")]

    def describe(self, peer: bytes) -> str:
        """Who `peer` is, for a log line: the worker whose pushes come from it."""
        rank = next((r for r, p in self._owner.items() if p == peer), None)
        return f"worker {rank}" if rank is not None else f"a connection that has not pushed ({peer!r})"

    @property
    def parts_joined(self) -> int:
        """Pushes that came in parts (sent while the worker's backward ran) and were joined."""
        return self._parts.joined

    def set_plan(self, plan: Plan, now: float, lazy: bool = False) -> list[Outgoing]:
        """A new batch plan: membership changes take effect (a departed worker's later steps
        are waited for by nobody; a re-filled rank binds to its new connection), and
        whatever waited on them is released (`lazy` as for handle). ValueError, and nothing
        changed, for a plan of another number of workers than the job's."""
        if len(plan.batches) != self.job.num_workers:  # (Plan.check keeps departed ranks within it)
            raise ValueError(f"the scheduler sent a plan for {len(plan.batches)} workers, the job has "
                             f"{self.job.num_workers}")
        return self._settled(lazy, self._set_plan, plan, now)

    def ready(self, hi: int) -> None:
        """Values [0, hi) hold the last step taken (and its wire-dtype copy, where a reply
        carries that). Ranges end at multiples of ALIGN, so the step written in ranges is
        bit-for-bit the step written whole."""
        due = self._due
        if due is None or hi <= due.done:
            return
        lo, hi = due.done, min(self.n, -(-hi // ALIGN) * ALIGN)
        self._write(due.grads, lo, hi, due.rank)
        if due.narrow:
            self.wire.narrow(self.values[lo:hi], self._wire_values[lo:hi])
        due.done = hi
        if hi == self.n:
            self._due = None
            if due.narrow:
                self._wire_version = self.version

    def _set_plan(self, plan: Plan, now: float) -> list[Outgoing]:
        before = self.plan.batches if self.plan is not None else [1] * len(plan.batches)
        self._plans[plan.gen] = tuple(plan.batches)
        if self.plan is None or plan.gen > self.plan.gen:
            self.plan = plan
        for rank, last in plan.departed:
            self._gone[rank] = (last, math.inf)
            self._parts.forget(rank)
            self._async.forget(rank)
            self._joiners.discard(rank)
            if rank in self._pending and self.version > last:
                del self._pending[rank]  # it died before every shard had its push: no shard uses it
        for rank, (b, was) in enumerate(zip(plan.batches, before)):
            if b and not was:  # (re)filled: a new worker, a new connection, its own step count
                last, _ = self._gone.get(rank, (-1, math.inf))
                if rank in self._gone:
                    self._gone[rank] = (last, plan.gen)
                self._owner.pop(rank, None)
                self._last_step.pop(rank, None)
                self._async.forget(rank)
                self._joiners.add(rank)
        if plan.stop:  # the job is ending: nobody waits for the slowest any more
            held, self._held = self._held, []
            return [self._reply(peer, p, now - t) for peer, p, t in held]
        if self.job.mode == "bsp":
            return self._release_gen_pulls(now) + self._try_complete(now)
        return self._release_held(now) if self.job.mode == "ssp" else []

    # -- ops ---------------------------------------------------------------------
    def _init(self, peer, msg: Init, now):
        if msg.rank != 0:
            return [_error(peer, "bad_rank", f"only worker 0 initialises shards, not worker {msg.rank}")]
        if self.initialized:
            return [_error(peer, "already_initialized", "this shard already holds values")]
        if msg.data.size != self.n:
            return [_error(peer, "bad_length", f"init carries {msg.data.size} values, shard holds {self.n}")]
        if msg.data.dtype != np.float32:
            return [_error(peer, "bad_dtype", f"init carries {name_of(msg.data)} values: initial values are float32")]
        if not all_finite(msg.data):
            return [_error(peer, "non_finite", "initial values contain NaN or inf")]
        refusal = self._claim(peer, msg.rank)
        if refusal:
            return [refusal]
        np.copyto(self.values, msg.data)
        self._writes += 1
        self.initialized = True
        return [Outgoing(peer, Ack())] + self._release_pulls(now)

    def _pull(self, peer, msg: Pull | Checkpoint, now):
        if isinstance(msg, Pull) and msg.gen >= 0 and self.job.mode == "bsp":
            if self._gen_ready(msg.gen):
                return [self._joiner_params(peer, msg.req, 0.0)]
            if len(self._gen_pulls) >= MAX_WAITING_PULLS:
                return [_error(peer, "busy", f"{MAX_WAITING_PULLS} pulls are already waiting")]
            self._gen_pulls.append((peer, msg, now))
            return []
        now_due = self.initialized and msg.at in (None, self.version)
        refusal = self._check_pull(msg, waits=not now_due)
        if refusal:
            return [self._refuse(peer, msg, *refusal)]
        if now_due:
            return [self._serve(peer, msg, 0.0)]
        self._pulls.append((peer, msg, now))
        return []

    def _check_pull(self, msg: Pull | Checkpoint, waits: bool) -> tuple[str, str] | None:
        """Why a pull or checkpoint is refused, as (code, text); None: it is served now, or
        (`waits`) in one of MAX_WAITING_PULLS places when the version reaches `at`."""
        if msg.at is not None and msg.at < self.version:
            return "version_passed", f"{msg.OP} at version {msg.at}, shard is at {self.version}"
        if msg.at is not None and msg.at > self._last_version():
            return "bad_version", f"{msg.OP} at version {msg.at}, which this job never reaches"
        if waits and len(self._pulls) >= MAX_WAITING_PULLS:
            return "busy", f"{MAX_WAITING_PULLS} pulls are already waiting"
        return None

    def _last_version(self) -> int:
        """The newest version a pull or checkpoint may wait for. With --max-steps the job
        ends there: a BSP version is a step, an ASP/SSP one an update, each applying at least
        one sample of the max_steps * global_batch the job trains on. Without it the job's
        length is the scheduler's to know (epochs of a dataset the server never loads):
        MAX_AHEAD versions ahead of now, which no job reaches, is the bound."""
        if self.job.max_steps is None:
            return self.version + MAX_AHEAD
        return self.job.max_steps * (1 if self.job.mode == "bsp" else self.job.global_batch)

    def _push(self, peer, msg: Push, now, segments: list | None = None, checked: bool = False):
        """A whole push, or one joined from parts (its values in `segments`; `checked`: known
        finite, its parts were checked as they came)."""
        if segments is None:
            segments = [(0, msg.data)] if msg.batch else []
        refusal = self._check_fields(peer, msg, sum(values.size for _, values in segments))
        if refusal:
            return [refusal]
        segments = self._float32(msg.rank, segments)
        if not (checked or all(all_finite(values) for _, values in segments)):
            return [_error(peer, "non_finite", f"gradient from worker {msg.rank} for step {msg.step} "
                                               "has NaN, inf or overflowing values")]
        self._claim(peer, msg.rank)
        self._joiners.discard(msg.rank)
        self._parts.void(peer, msg)  # a whole push of the step it was sending in parts (once accepted)
        segments = aligned(segments)
        if self.job.mode == "bsp":
            self._pending[msg.rank] = (peer, msg, now, segments)
            self._pending_gen = msg.gen
            return self._release_gen_pulls(now) + self._try_complete(now)
        return self._apply_asp(peer, msg, segments, now) + self._release_pulls(now)

    def _check_fields(self, peer, msg: Push, size: int | None = None) -> Outgoing | None:
        """The checks of a push, with its `size` once whole: each of its parts passes the
        others before it is assembled (the assembler checks where a part lies), and the
        joined push all of them again (the state may have moved)."""
        if not self.initialized:
            return _error(peer, "not_ready", "shard not initialised yet: pull first")
        if msg.rank >= self.job.num_workers:
            return _error(peer, "bad_rank", f"worker rank {msg.rank} outside 0..{self.job.num_workers - 1}")
        if self._excluded(msg.rank, msg.gen, msg.step):
            return _error(peer, "removed", f"worker {msg.rank} was removed from the job after step "
                                           f"{self._gone[msg.rank][0]}")
        owner = self._owner.get(msg.rank)
        if owner is not None and owner != peer:
            return _error(peer, "rank_taken", f"worker rank {msg.rank} is bound to another connection")
        refusal = self._wrong_dtype(peer, msg)
        if refusal:
            return refusal
        if size is not None and msg.batch and size != self.n:
            return _error(peer, "bad_length", f"push carries {size} values, shard holds {self.n}")
        if msg.ver > self.version:
            return _error(peer, "bad_version", f"push computed on version {msg.ver}, shard is at {self.version}")
        if self.job.mode == "bsp":
            if msg.step != self.version:
                return _error(peer, "bad_step", f"push for step {msg.step}, shard is collecting step {self.version}")
            if msg.rank in self._pending:
                return _error(peer, "duplicate", f"worker {msg.rank} already pushed step {msg.step}")
            if self._plans and msg.gen < min(self._plans):
                # the steps under it are done: no step would run it, and a step waiting for it never ends
                return _error(peer, "bad_gen", f"push under plan {msg.gen}, which no step runs any more: this shard "
                                               f"keeps plans {sorted(self._plans)}")
            if self._pending and msg.gen != self._pending_gen:
                return _error(peer, "bad_gen", f"push under plan {msg.gen}, step {msg.step} runs plan "
                                               f"{self._pending_gen}")
            if not self._plans.get(msg.gen, (1,) * self.job.num_workers)[msg.rank]:
                return _error(peer, "not_in_plan", f"worker {msg.rank} has no batch in plan {msg.gen}")
        elif msg.step <= self._last_step.get(msg.rank, -1):
            return _error(peer, "duplicate", f"worker {msg.rank} already pushed step {msg.step}")
        elif any((held, p.rank) == (peer, msg.rank) for held, p, _ in self._held):
            return _error(peer, "reply_held", f"worker {msg.rank}'s last push is still unanswered (SSP holds the "
                                              "reply until the slowest worker is near): a worker pushes again "
                                              "only once answered")
        return None

    def _wrong_dtype(self, peer, msg: Push) -> Outgoing | None:
        """A push (or a part of one) whose values are not in the job's wire dtype is refused."""
        if msg.batch and msg.data.dtype != self.wire.dtype:
            return _error(peer, "bad_dtype", f"push carries {name_of(msg.data)} values, the job's wire dtype is "
                                             f"{self.wire.name}")
        return None

    def _float32(self, rank: int, segments: list) -> list:
        """A push's values in float32: narrow ones (checked, so not a duplicate of a pending
        push) widened into its rank's buffer (BSP keeps it until the barrier; ASP applies it
        at once, so one buffer serves all), whole."""
        if self.wire.exact or not segments:
            return segments
        slot = rank if self.job.mode == "bsp" else 0
        if slot not in self._widened:
            self._widened[slot] = aligned_empty(self.n)  # once per rank, not per step
        out = self._widened[slot]
        for lo, values in segments:
            self.wire.widen(values, out[lo:lo + values.size])
        return [(0, out)]

    def _claim(self, peer, rank) -> Outgoing | None:
        owner = self._owner.setdefault(rank, peer)
        if owner != peer:
            return _error(peer, "rank_taken", f"worker rank {rank} is bound to another connection")
        return None

    def _excluded(self, rank: int, gen: int, step: int) -> bool:
        """The worker that held `rank` under plan `gen` is gone, and `step` is past its last."""
        last, refilled_at = self._gone.get(rank, (math.inf, 0))
        return step > last and gen < refilled_at

    # -- BSP barrier -------------------------------------------------------------
    def _try_complete(self, now):
        """Apply the step when every worker of its plan that is still there has pushed
        (a plan this shard has not received yet: wait for it)."""
        batches = self._plans.get(self._pending_gen)
        if not self._pending or batches is None:
            return []
        waiting = [r for r, b in enumerate(batches) if b and r not in self._pending
                   and not self._excluded(r, self._pending_gen, self.version)]
        return [] if waiting else self._apply_bsp(now)

    def _gen_ready(self, gen: int) -> bool:
        return self._pending_gen is not None and self._pending_gen >= gen and self._pending_gen in self._plans

    def _release_gen_pulls(self, now):
        ready = [e for e in self._gen_pulls if self._gen_ready(e[1].gen)]
        self._gen_pulls = [e for e in self._gen_pulls if not self._gen_ready(e[1].gen)]
        return [self._joiner_params(peer, m.req, now - t) for peer, m, t in ready]

    def _joiner_params(self, peer, req, held_s) -> Outgoing:
        """The values a joining worker starts from, with the plan the step runs (the joiner's
        welcome may hold an older one)."""
        plan = {"gen": self._pending_gen, "batches": list(self._plans[self._pending_gen]), "stop": False}
        return Outgoing(peer, Params(req=req, version=self.version, held_s=held_s, plan=plan, data=self.frozen()),
                        snapshot=True)

    # -- updates -----------------------------------------------------------------
    def _apply_bsp(self, now):
        pushes = [self._pending[r] for r in sorted(self._pending)]
        grads = [(p.batch, segments) for _, p, _, segments in pushes if p.batch]  # dropped ones weigh nothing
        if grads:
            total = sum(batch for batch, _ in grads)
            self._take_step([(batch / total, segments) for batch, segments in grads], self.job.lr)
        self.version += 1  # even with every gradient dropped: versions count steps in BSP
        self.updates += bool(grads)
        self._pending.clear()
        self._plans = {g: b for g, b in self._plans.items() if g >= self._pending_gen}  # older ones are done
        self._pending_gen = None
        replies = [self._reply(peer, p, now - t) for peer, p, t, _ in pushes]
        return replies + self._release_pulls(now)

    def _apply_asp(self, peer, msg: Push, segments: list, now):
        if msg.batch:  # a dropped gradient changes nothing but the worker's progress
            staleness = self.version - msg.ver
            lr = self.job.lr * msg.batch / self._b_ref
            if self.job.staleness_lr == "inverse":
                lr /= 1 + staleness
            self._async.observe(staleness)
            lr, decay = self._async.step(lr, self._b_ref / self.job.global_batch, self._opt)
            self._take_step([(1.0, segments)], lr, decay, msg.rank)
            self.version += 1
            self.updates += 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
        self._last_step[msg.rank] = msg.step
        if self.job.mode == "asp":
            return [self._reply(peer, msg, 0.0)]
        # its fields are all the reply needs: the gradient's frames are not kept while it waits
        self._held.append((peer, replace(msg, data=_NO_VALUES), now))
        return self._release_held(now)

    def _release_held(self, now):
        """SSP: answer the held pushes that are within `staleness` steps of the slowest
        worker still in the job (one that just joined counts from its first push)."""
        batches = self.plan.batches if self.plan is not None else [1] * self.job.num_workers
        steps = [self._last_step.get(r, -1) for r, b in enumerate(batches) if b and r not in self._joiners]
        slowest = min(steps, default=math.inf)
        ready = [h for h in self._held if h[1].step - slowest <= self.job.staleness]
        self._held = [h for h in self._held if h[1].step - slowest > self.job.staleness]
        return [self._reply(p_peer, p, now - t) for p_peer, p, t in ready]

    def _take_step(self, grads: list, lr: float, decay: float | None = None, rank: int = -1) -> None:
        """An optimizer step on the weighted sum of `grads`, (weight, segments) pairs (with
        momentum `decay`, None: the recipe's; `rank`: the pushing worker in ASP/SSP); ready()
        writes its values."""
        self.ready(self.n)
        self._writes += 1
        if self.trained:
            self._opt.begin(lr, decay)
        self._due = _Due([(weight, segments, [a for a, _ in segments]) for weight, segments in grads], rank)

    def _write(self, grads: list, lo: int, hi: int, rank: int) -> None:
        """Values [lo, hi) of the step on `grads`: the optimizer's update, while buffer slots
        simply take the gradient's values."""
        (weight, segments, starts), *more = grads
        segments = _window(segments, starts, lo, hi)
        if more or weight != 1:  # the BSP mean of several pushes, summed in rank order
            for a, values in segments:
                np.multiply(values, weight, out=self._agg[a:a + values.size])
            agg = torch.from_numpy(self._agg)
            for weight, others, starts in more:
                for a, values in _window(others, starts, lo, hi):
                    agg[a:a + values.size].add_(torch.from_numpy(values), alpha=weight)
            segments = [(lo, self._agg[lo:hi])]
        t = self.trained
        if lo < t:
            grad = [(a, self._async.gradient(rank, a, values[:t - a], self.values)) for a, values in segments if a < t]
            self._opt.apply([(a, torch.from_numpy(values)) for a, values in grad])
            self._async.updated(lo, hi, self.values)
        for a, values in segments:
            if a + values.size > t:
                np.copyto(self.values[max(a, t):a + values.size], values[max(0, t - a):])

    # -- state -------------------------------------------------------------------
    def state(self) -> ShardState:
        self.ready(self.n)
        scalars, buffers = self._opt.state()
        return ShardState(
            meta={"job": self.job.to_dict(), "size": self.n, "trained": self.trained, "version": self.version,
                  "updates": self.updates, "staleness": [self.staleness_sum, self.staleness_max],
                  "last_step": [self._last_step.get(r, -1) for r in range(self.job.num_workers)],
                  "optimizer": scalars, "asynchrony": self._async.state()},
            arrays={"values": self.frozen(), **{f"opt.{k}": v for k, v in buffers.items()}})

    def frozen(self) -> np.ndarray:
        """The values as a read-only copy, taken when a snapshot reply (a pull, a joiner's
        values) or a checkpoint's state is due: a reply's receiver may never read it, so it
        cannot alias the shard, which the next step changes. What is due between two changes
        of the values shares one copy, kept only as long as one of them holds it: pulls that
        pile up unread (a flood, evaluation pulls released together) would otherwise hold a
        copy each, and a checkpoint at an evaluation's step one more."""
        self.ready(self.n)
        if self._frozen is not None and self._frozen[0] == self._writes:
            copy = self._frozen[1]()
            if copy is not None:
                return copy
        copy = self.values.copy()
        copy.flags.writeable = False
        self._frozen = (self._writes, weakref.ref(copy))
        return copy

    def detach(self) -> None:
        """Move the shard to fresh buffers with the same values, leaving the current ones to
        the replies still queued that alias them (zero-copy): what changes the shard next
        cannot tear them. One copy, where waiting would hold the server up for as long as
        a receiver does not read (a worker frozen or slow)."""
        self.ready(self.n)
        values = aligned_empty(self.n)
        np.copyto(values, self.values)
        self.values = values
        self._opt.param = torch.from_numpy(values[:self.trained])  # updated in place; nothing else holds a view
        if self._wire_values is not None:  # replies in the wire dtype alias this one
            self._wire_values = self.wire.buffer(self.n)
            self._wire_version = None
        self._async.detach()
        self.detached += 1

    def rewind(self) -> None:
        """Forget every request, binding and plan: the job goes back to a checkpoint (a
        restore follows) and the workers come back on new connections."""
        self.ready(self.n)
        self._pending.clear()
        self._pending_gen = None
        self._held, self._pulls, self._gen_pulls = [], [], []
        self._parts.clear()
        self._async.forget()
        self._owner.clear()
        self._gone.clear()
        self._joiners.clear()
        self._plans = {}
        self.plan = None

    def restore(self, state: ShardState, next_steps: list[int] | None = None) -> None:
        """Take `state`, from state() of a shard of the same job and range. `next_steps`:
        the step each worker pushes next when the workers resume from the same checkpoint
        (an ASP snapshot may hold an update whose report the scheduler had not counted:
        that worker pushes its step again). Raises ValueError, changing nothing, when the
        state does not fit this shard or requests are in flight."""
        self.ready(self.n)  # the step taken last is part of the state it replaces
        m, arrays, workers = state.meta, state.arrays, self.job.num_workers
        if self._pending or self._held or self._pulls:
            raise ValueError("a shard with requests in flight cannot be restored")
        if not same_job(m.get("job"), self.job):
            raise ValueError("the saved shard belongs to another job (its settings differ)")
        if (m.get("size"), m.get("trained")) != (self.n, self.trained):
            raise ValueError(f"the saved shard holds {m.get('size')} values ({m.get('trained')} trained), "
                             f"this one {self.n} ({self.trained})")
        values = arrays.get("values")
        if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != (self.n,):
            raise ValueError(f"the saved values are not {self.n} float32 numbers")
        last, stale = m.get("last_step"), m.get("staleness")
        if not (_ints(m.get("version"), m.get("updates"), lowest=0) and isinstance(stale, list) and len(stale) == 2
                and _ints(*stale, lowest=0) and isinstance(last, list) and len(last) == workers
                and _ints(*last, lowest=-1) and isinstance(m.get("optimizer"), dict)):
            raise ValueError("the saved shard's counters are malformed")
        if next_steps is not None and not (len(next_steps) == workers and _ints(*next_steps, lowest=0)):
            raise ValueError(f"next steps {next_steps} are not one step count per worker")
        buffers = {k.removeprefix("opt."): v for k, v in arrays.items() if k != "values"}
        if any(not k.startswith("opt.") for k in arrays if k != "values"):
            raise ValueError(f"the saved shard holds unknown arrays: {sorted(arrays)}")
        self._async.check_state(m.get("asynchrony"))
        self._opt.load_state(m["optimizer"], buffers)  # checks before it changes anything
        self._async.load_state(m.get("asynchrony"))
        np.copyto(self.values, values)
        self._writes += 1
        self._wire_version = None
        self.version, self.updates = m["version"], m["updates"]
        self.staleness_sum, self.staleness_max = stale
        self._last_step = ({r: s for r, s in enumerate(last) if s >= 0} if next_steps is None
                           else {r: s - 1 for r, s in enumerate(next_steps) if s > 0})
        self.initialized = True

    # -- replies -----------------------------------------------------------------
    def _serve(self, peer, msg: Pull | Checkpoint, held_s):
        if isinstance(msg, Checkpoint):
            return Snapshot(peer, msg.req, msg.step, self.state())
        return self._params(peer, msg.req, held_s, None, snapshot=True)

    def _refuse(self, peer, msg: Pull | Checkpoint, code, text):
        if isinstance(msg, Checkpoint):  # answered in kind: the scheduler counts the checkpoint's answers
            return Outgoing(peer, Saved(req=msg.req, step=msg.step, version=self.version, error=f"{code}: {text}"))
        return _error(peer, code, text)

    def _reply(self, peer, push: Push, held_s) -> Outgoing:
        """The answer to `push`: the shard after its step, in the parts the worker asked for
        (larger where it asked for more than MAX_PARTS)."""
        if self._async.tracks_sent:
            self.ready(self.n)
            self._async.sent(push.rank, self.values)
        out = self._params(peer, push.step, held_s, push.gen)
        part = max(push.reply_part, -(-self.n // MAX_PARTS)) if push.reply_part else 0
        if not 0 < part < self.n:
            return out
        self.replies_in_parts += 1
        return replace(out, part=part)

    def _params(self, peer, req, held_s, gen_seen, snapshot=False):
        """A reply with the shard: to a pull (snapshot) in float32, to a push in the wire dtype."""
        plan = None
        if self.plan is not None and gen_seen is not None and gen_seen < self.plan.gen:
            plan = {"gen": self.plan.gen, "batches": self.plan.batches, "stop": self.plan.stop}
        data = self.frozen() if snapshot else self._narrowed()
        return Outgoing(peer, Params(req=req, version=self.version, held_s=held_s, plan=plan, data=data), snapshot)

    def _narrowed(self) -> np.ndarray:
        """The shard in the wire dtype, narrowed once per version (a step's ranges as ready()
        writes them). Replies alias it (zero-copy, tracked), as they alias `values` in
        float32: the server waits for them to leave before handling anything that can change
        the values."""
        if self._async.moves_replies:  # look-ahead values, derived from the whole step
            self.ready(self.n)
            data = self._async.reply(self.values, self._opt, self.version)
            if data is not self.values:
                if self.wire.exact:
                    return data
                self.wire.narrow(data, self._wire_values)
                self._wire_version = None  # it holds other values than the shard's
                return self._wire_values
        if self.wire.exact:
            return self.values
        due = self._due
        if due is not None:
            if not due.narrow:
                self.wire.narrow(self.values[:due.done], self._wire_values[:due.done])
                due.narrow = True
        elif self._wire_version != self.version:
            self.wire.narrow(self.values, self._wire_values)
            self._wire_version = self.version
        return self._wire_values

    def _release_pulls(self, now):
        ready, waiting = [], []
        for entry in self._pulls:
            (ready if entry[1].at in (None, self.version) else waiting).append(entry)
        self._pulls = waiting
        return [self._serve(peer, m, now - t) for peer, m, t in ready]


def _window(segments: list, starts: list[int], lo: int, hi: int) -> list:
    """The parts inside [lo, hi) of (offset, values) segments sorted by offset (`starts`): found
    by bisection, so that a step written in many ranges of a push in many parts stays linear."""
    out = []
    for i in range(max(0, bisect.bisect_right(starts, lo) - 1), len(segments)):
        a, values = segments[i]
        if a >= hi:
            break
        if a + values.size > lo:
            out.append((max(a, lo), values[max(0, lo - a):hi - a]))
    return out


def _ints(*values, lowest: int) -> bool:
    return all(type(v) is int and v >= lowest for v in values)


def _error(peer, code, text) -> Outgoing:
    return Outgoing(peer, Error(code=code, text=text))
