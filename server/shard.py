"""One server's shard and its synchronisation rules, with no I/O (sans-IO core).

`ShardCore.handle(peer, msg, now)` takes a decoded message from a worker (or the
scheduler's evaluation pulls) and returns the replies to send. A refused message
gets an `Error` reply and leaves every piece of state as it was.

BSP: collect one push per worker for step t (server/barrier.py), apply
g = sum(b_i g_i) / sum(b_i) (summed in rank order, so runs are bit-for-bit
repeatable), then answer all of them with the new shard. ASP: apply each push on
arrival, corrected for its staleness (server/asynchrony.py; with --staleness-lr inverse
its learning rate is also divided by 1 + staleness). SSP: as ASP, but the reply to a
worker's step s waits until s - (the slowest worker's last step) <= S (server/holds.py).
Shard slots past the trained parameters hold model buffers (e.g. normalisation
statistics): they take the batch-weighted mean of the pushed values (BSP) or the
latest pushed values (ASP) and never see the optimizer. server/values.py holds the
values, written in ranges (`lazy`), and the buffers replies alias. Init, pulls and
checkpoints stay float32: they set or save state, which must not lose precision.
A push may come in parts (buckets a worker sends while its backward pass runs):
server/assembly.py joins them (in the wire dtype), and the core sees one push whose
values are the parts as received, (offset, values) segments re-cut at aligned places
(server/segments.py) so that applying them is bit-for-bit applying the whole.
A `checkpoint` request is served like a pull (at once, or when the version reaches
`at`, server/pulls.py): the core answers with a `Snapshot` instruction holding a copy
of its state (server/shard_state.py), which the server writes; `restore` takes it back.
"""

from dataclasses import dataclass, replace

import numpy as np

from omnips.batching import BatchPlan
from omnips.flat import all_finite
from omnips.job import JobSpec
from omnips.protocol import MAX_PARTS, Ack, Checkpoint, Error, Init, Message, Params, Plan, Pull, Push, Saved
from omnips.wire import name_of

from .assembly import Assembler, PartRefused
from .barrier import MAX_WAITING_PULLS, Barrier
from .holds import Holds
from .members import Members
from .pulls import Waiting
from .segments import aligned
from .shard_state import ShardState, Snapshot, check_saved
from .values import ShardValues


@dataclass(frozen=True)
class Outgoing:
    to: bytes
    msg: Message
    snapshot: bool = False  # the data is a frozen() copy (pulls: the receiver may never read): sent untracked
    part: int = 0  # send Params in parts of this many values, the first ones first (0: whole)


_NO_VALUES = np.empty(0, np.float32)


class ShardCore:
    def __init__(self, job: JobSpec, lo: int, hi: int, num_trained: int):
        self.job = job
        self.n = hi - lo
        self.trained = max(0, min(hi, num_trained) - lo)  # local slots [0, trained) are parameters
        self.store = ShardValues(job, self.n, self.trained)
        self.wire = self.store.wire
        self._b_ref = job.global_batch / job.num_workers
        self.version = 0
        self.initialized = False
        self.plan: BatchPlan | None = None  # the newest, handed on with replies
        self.barrier = Barrier(job.num_workers)  # BSP
        self.holds = Holds(job.staleness)  # ASP/SSP (its last steps are part of every mode's state)
        self.members = Members()
        self._pulls = Waiting(job)  # for init or for `at`
        self._parts = Assembler(self.n, max_open=2 * job.num_workers, check=self.wire.exact)  # pushes sent in buckets
        self.staleness_sum = 0
        self.staleness_max = 0
        self.updates = 0
        self.replies_in_parts = 0

    @property
    def values(self) -> np.ndarray:
        return self.store.values

    @property
    def detached(self) -> int:
        return self.store.detached

    # -- entry point -------------------------------------------------------------
    def handle(self, peer: bytes, msg: Message, now: float, lazy: bool = False) -> list[Outgoing | Snapshot]:
        """The replies to `msg`. `lazy`: the values a step it completes writes are left to
        ready(), which must be called before anything is read from them."""
        return self._settled(lazy, self._handle, peer, msg, now)

    def ready(self, hi: int) -> None:
        """Values [0, hi) hold the last step taken (server/values.py)."""
        self.store.ready(hi)

    def frozen(self) -> np.ndarray:
        return self.store.frozen()

    def detach(self) -> None:
        self.store.detach()

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
        rank = self.members.rank_of(peer)
        return f"worker {rank}" if rank is not None else f"a connection that has not pushed ({peer!r})"

    @property
    def parts_joined(self) -> int:
        """Pushes that came in parts (sent while the worker's backward ran) and were joined."""
        return self._parts.joined

    def set_plan(self, msg: Plan, now: float, lazy: bool = False) -> list[Outgoing]:
        """A new batch plan: membership changes take effect (a departed worker's later steps
        are waited for by nobody; a re-filled rank binds to its new connection), and
        whatever waited on them is released (`lazy` as for handle). ValueError, and nothing
        changed, for a plan of another number of workers than the job's."""
        try:  # (Plan.check keeps departed ranks within it)
            msg.plan.sized(self.job.num_workers)
        except ValueError as exc:
            raise ValueError(f"the scheduler sent {exc}") from None
        return self._settled(lazy, self._set_plan, msg.plan, msg.departed, now)

    def _set_plan(self, plan: BatchPlan, departed: tuple, now: float) -> list[Outgoing]:
        before = self.plan.batches if self.plan is not None else [1] * len(plan.batches)
        self.barrier.plans[plan.gen] = tuple(plan.batches)
        if self.plan is None or plan.gen > self.plan.gen:
            self.plan = plan
        for rank, last in departed:
            self.members.departed(rank, last)
            self._parts.forget(rank)
            self.store.correction.forget(rank)
            self.holds.joiners.discard(rank)
            self.barrier.departed(rank, last, self.version)
        for rank, (b, was) in enumerate(zip(plan.batches, before)):
            if b and not was:  # (re)filled: a new worker, a new connection, its own step count
                self.members.refilled(rank, plan.gen)
                self.holds.refilled(rank)
                self.store.correction.forget(rank)
        if self.job.mode == "bsp":  # (a stop's plan too: it names the workers lost during the stop)
            return self._release_gen_pulls(now) + self._try_complete(now)
        if plan.stop:  # the job is ending: nobody waits for the slowest any more
            return [self._reply(peer, p, now - t) for peer, p, t in self.holds.release_all()]
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
        refusal = self.members.claim(peer, msg.rank)
        if refusal:
            return [_error(peer, *refusal)]
        self.store.load(msg.data)
        self.initialized = True
        return [Outgoing(peer, Ack())] + self._release_pulls(now)

    def _pull(self, peer, msg: Pull | Checkpoint, now):
        if isinstance(msg, Pull) and msg.gen >= 0 and self.job.mode == "bsp":
            if self.barrier.gen_ready(msg.gen):
                return [self._joiner_params(peer, msg, 0.0)]
            if not self.barrier.wait_pull(peer, msg, now):
                return [_error(peer, "busy", f"{MAX_WAITING_PULLS} pulls are already waiting")]
            return []
        now_due = self.initialized and msg.at in (None, self.version)
        refusal = self._pulls.refusal(msg, self.version, waits=not now_due)
        if refusal:
            return [self._refuse(peer, msg, *refusal)]
        if now_due:
            return [self._serve(peer, msg, 0.0)]
        self._pulls.add(peer, msg, now)
        return []

    def _push(self, peer, msg: Push, now, segments: list | None = None, checked: bool = False):
        """A whole push, or one joined from parts (its values in `segments`; `checked`: known
        finite, its parts were checked as they came)."""
        if segments is None:
            segments = [(0, msg.data)] if msg.batch else []
        refusal = self._check_fields(peer, msg, sum(values.size for _, values in segments))
        if refusal:
            return [refusal]
        segments = self.store.float32(msg.rank, segments)
        if not (checked or all(all_finite(values) for _, values in segments)):
            return [_error(peer, "non_finite", f"gradient from worker {msg.rank} for step {msg.step} "
                                               "has NaN, inf or overflowing values")]
        self.members.claim(peer, msg.rank)  # free or its own: checked above
        self.holds.joiners.discard(msg.rank)
        self._parts.void(peer, msg)  # a whole push of the step it was sending in parts (once accepted)
        segments = aligned(segments)
        if self.job.mode == "bsp":
            self.barrier.add(peer, msg, now, segments)
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
        refusal = self.members.refusal(peer, msg.rank, msg.gen, msg.step)
        if refusal:
            return _error(peer, *refusal)
        if msg.batch and msg.data.dtype != self.wire.dtype:
            return _error(peer, "bad_dtype", f"push carries {name_of(msg.data)} values, the job's wire dtype is "
                                             f"{self.wire.name}")
        if size is not None and msg.batch and size != self.n:
            return _error(peer, "bad_length", f"push carries {size} values, shard holds {self.n}")
        if msg.version > self.version:
            return _error(peer, "bad_version", f"push computed on version {msg.version}, shard is at {self.version}")
        refusal = self.barrier.refusal(msg, self.version) if self.job.mode == "bsp" else self.holds.refusal(peer, msg)
        return _error(peer, *refusal) if refusal else None

    # -- BSP barrier -------------------------------------------------------------
    def _try_complete(self, now):
        """Apply the step when every worker of its plan that is still there has pushed
        (a plan this shard has not received yet: wait for it)."""
        return self._apply_bsp(now) if self.barrier.waiting(self.version, self.members.excluded) == [] else []

    def _release_gen_pulls(self, now):
        return [self._joiner_params(peer, m, now - t) for peer, m, t in self.barrier.due_pulls()]

    def _joiner_params(self, peer, pull: Pull, held_s) -> Outgoing:
        """The values a joining worker starts from, with the plan the step runs (the joiner's
        welcome may hold an older one)."""
        gen = self.barrier.gen
        plan = BatchPlan(gen, self.barrier.plans[gen])
        return Outgoing(peer, Params(request=pull.request, version=self.version, held_s=held_s, plan=plan,
                                     data=self.frozen()), snapshot=True)

    # -- updates -----------------------------------------------------------------
    def _apply_bsp(self, now):
        pushes = self.barrier.take()
        grads = [(p.batch, segments) for _, p, _, segments in pushes if p.batch]  # dropped ones weigh nothing
        if grads:
            total = sum(batch for batch, _ in grads)
            self.store.take([(batch / total, segments) for batch, segments in grads], self.version + 1, self.job.lr)
        self.version += 1  # even with every gradient dropped: versions count steps in BSP
        self.updates += bool(grads)
        replies = [self._reply(peer, p, now - t) for peer, p, t, _ in pushes]
        return replies + self._release_pulls(now)

    def _apply_asp(self, peer, msg: Push, segments: list, now):
        if msg.batch:  # a dropped gradient changes nothing but the worker's progress
            staleness = self.version - msg.version
            lr = self.job.lr * msg.batch / self._b_ref
            if self.job.staleness_lr == "inverse":
                lr /= 1 + staleness
            correction = self.store.correction
            correction.observe(staleness)
            lr, decay = correction.step(lr, self._b_ref / self.job.global_batch, self.store.opt)
            self.store.take([(1.0, segments)], self.version + 1, lr, decay, msg.rank)
            self.version += 1
            self.updates += 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
        self.holds.last_step[msg.rank] = msg.step
        if self.job.mode == "asp":
            return [self._reply(peer, msg, 0.0)]
        # its fields are all the reply needs: the gradient's frames are not kept while it waits
        self.holds.hold(peer, replace(msg, data=_NO_VALUES), now)
        return self._release_held(now)

    def _release_held(self, now):
        """SSP: answer the held pushes that are within `staleness` steps of the slowest
        worker still in the job."""
        batches = self.plan.batches if self.plan is not None else [1] * self.job.num_workers
        return [self._reply(peer, p, now - t) for peer, p, t in self.holds.release(batches, now)]

    # -- state -------------------------------------------------------------------
    def state(self) -> ShardState:
        self.ready(self.n)
        scalars, buffers = self.store.opt.state()
        return ShardState(
            meta={"job": self.job.to_dict(), "size": self.n, "trained": self.trained, "version": self.version,
                  "updates": self.updates, "staleness": [self.staleness_sum, self.staleness_max],
                  "last_step": [self.holds.last_step.get(r, -1) for r in range(self.job.num_workers)],
                  "optimizer": scalars, "asynchrony": self.store.correction.state()},
            arrays={"values": self.frozen(), **{f"opt.{k}": v for k, v in buffers.items()},
                    **{f"async.{k}": v for k, v in self.store.correction.arrays().items()}})

    def rewind(self) -> None:
        """Forget every request, binding and plan: the job goes back to a checkpoint (a
        restore follows) and the workers come back on new connections."""
        self.ready(self.n)
        self.barrier.clear()
        self.holds.clear()
        self._pulls.entries = []
        self._parts.clear()
        self.store.correction.forget()
        self.members.clear()
        self.plan = None

    def restore(self, state: ShardState, next_steps: list[int] | None = None) -> None:
        """Take `state`, from state() of a shard of the same job and range. `next_steps`:
        the step each worker pushes next when the workers resume from the same checkpoint
        (an ASP snapshot may hold an update whose report the scheduler had not counted:
        that worker pushes its step again). Raises ValueError, changing nothing, when the
        state does not fit this shard or requests are in flight."""
        self.ready(self.n)  # the step taken last is part of the state it replaces
        if self.barrier.pending or self.holds.held or self._pulls.entries:
            raise ValueError("a shard with requests in flight cannot be restored")
        m, buffers, kept = check_saved(state, self.job, self.n, self.trained, next_steps)
        correction = self.store.correction
        correction.check_state(m.get("asynchrony"), kept, self.job.num_workers)
        self.store.opt.load_state(m["optimizer"], buffers)  # checks before it changes anything
        correction.load_state(m.get("asynchrony"), kept)
        self.store.load(state.arrays["values"])
        self.version, self.updates = m["version"], m["updates"]
        self.staleness_sum, self.staleness_max = m["staleness"]
        self.holds.last_step = ({r: s for r, s in enumerate(m["last_step"]) if s >= 0} if next_steps is None
                                else {r: s - 1 for r, s in enumerate(next_steps) if s > 0})
        self.initialized = True

    # -- replies -----------------------------------------------------------------
    def _serve(self, peer, msg: Pull | Checkpoint, held_s):
        if isinstance(msg, Checkpoint):
            return Snapshot(peer, msg.request, msg.step, self.state())
        return self._params(peer, msg, held_s)

    def _refuse(self, peer, msg: Pull | Checkpoint, code, text):
        if isinstance(msg, Checkpoint):  # answered in kind: the scheduler counts the checkpoint's answers
            return Outgoing(peer, Saved(request=msg.request, step=msg.step, version=self.version,
                                        error=f"{code}: {text}"))
        return _error(peer, code, text)

    def _reply(self, peer, push: Push, held_s) -> Outgoing:
        """The answer to `push`: the shard after its step, in the parts the worker asked for
        (larger where it asked for more than MAX_PARTS)."""
        if self.store.correction.tracks_sent:
            self.ready(self.n)
            self.store.correction.sent(push.rank, self.values)
        out = self._params(peer, push, held_s)
        part = max(push.reply_part, -(-self.n // MAX_PARTS)) if push.reply_part else 0
        if not 0 < part < self.n:
            return out
        self.replies_in_parts += 1
        return replace(out, part=part)

    def _params(self, peer, answered: Pull | Push, held_s):
        """A reply with the shard: to a pull (a snapshot) in float32, to a push in the wire
        dtype with the newest plan if the worker has not seen it."""
        if isinstance(answered, Pull):
            return Outgoing(peer, Params(request=answered.request, version=self.version, held_s=held_s, plan=None,
                                         data=self.frozen()), snapshot=True)
        plan = self.plan if self.plan is not None and answered.gen < self.plan.gen else None
        return Outgoing(peer, Params(step=answered.step, version=self.version, held_s=held_s, plan=plan,
                                     data=self.store.narrowed(self.version)))

    def _release_pulls(self, now):
        return [self._serve(peer, m, now - t) for peer, m, t in self._pulls.due(self.version)]


def _error(peer, code, text) -> Outgoing:
    return Outgoing(peer, Error(code=code, text=text))
