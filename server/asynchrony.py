"""Asynchronous updates that train with a BSP recipe (ASP and SSP, `--async-correction`).

A gradient pushed in ASP was computed on values `staleness` updates old: with N workers
of equal speed about N - 1. Such delays act like momentum of about s / (1 + s), s the
mean staleness (Mitliagkas et al. 2016, "Asynchrony begets momentum"), on top of the
optimizer's own, so a recipe with momentum 0.9 overshoots and trains nothing. Each
correction works on one shard alone, from what that shard sees (no traffic between
shards per update):

- `dana` (DANA-Zero, Hakimi et al. 2019): SGD's momentum kept in one buffer per worker,
  each decaying once per update of its own worker, and the shard kept at the point
  moved ahead along all of them (Dana); with Adam, `momentum`'s update;
- `momentum`: an update's momentum (SGD) or beta1 (Adam) is the recipe's less the
  implicit momentum s / (1 + s), at least 0, and its learning rate keeps most of the
  step BSP takes per sample (MomentumCorrection);
- `lookahead` (DANA, Hakimi et al. 2019): a reply carries the values moved ahead along
  the optimizer's momentum by the s updates expected before the worker's next gradient
  lands, so that the gradient is computed near where it will be applied;
- `dc` (DC-ASGD, Zheng et al. 2017): the gradient plus lambda * g * g * (values now -
  values sent to that worker);
- `gap` (Gap-Aware, Barkai et al. 2020): each value's gradient divided by max(1, gap / C),
  gap = |values now - values sent to that worker|, C the mean size of one update of it;
- `none`: the optimizer's update at the recipe's momentum and lr * b_i / b_ref (b_ref =
  B / N: N times BSP's step per sample).

Every correction but `none` scales an update's learning rate to its share of the global
batch, lr * b_i / B: BSP's step per sample.

s is a running mean of the staleness this shard measured. With staleness 0 throughout
(one worker) every correction leaves the update and the reply bit-for-bit as they are.
"""

import math

import numpy as np
import torch

from omnips.flat import aligned_empty, aligned_zeros
from omnips.optim import SGD, fused_sgd

KEEP_STEP = 0.7  # of the recipe's long-run step per sample that the momentum correction keeps
MEAN_SPAN = 32  # updates the running mean of staleness averages over, about
DC_LAMBDA = 0.04  # MXNet's DCASGD default
GAP_SPAN = 16  # updates the mean step size of gap-aware damping averages over, about


class Correction:
    """`none`: the optimizer's update. The base of the others: the staleness measured."""

    moves_replies = False  # reply() may return other values than the shard's: it reads them whole
    tracks_sent = False  # sent() is called, with the whole step written

    def __init__(self, trained: int):
        self.trained = trained  # corrections touch local slots [0, trained): parameters
        self.staleness = 0.0  # running mean
        self._seen = 0

    def observe(self, staleness: int) -> None:
        """An update `staleness` versions behind is about to be applied."""
        self._seen += 1
        self.staleness += (staleness - self.staleness) / min(self._seen, MEAN_SPAN)

    def step(self, lr: float, share: float, opt) -> tuple[float, float | None]:
        """(learning rate, momentum or beta1: None for the recipe's) of an update whose
        plain learning rate is `lr` (the recipe's * b_i / b_ref); `share` = b_ref / B, the
        mean share of the global batch an update carries."""
        return lr, None

    def gradient(self, rank: int, lo: int, grad: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The gradient to apply at slots [lo, lo + grad.size) of `values` (before the update)."""
        return grad

    def apply(self, rank: int, grads: list, values: np.ndarray, opt) -> None:
        """The update of `values` by worker `rank`'s gradient, (offset, array) segments
        within the parameters: the optimizer's step on gradient() of each."""
        opt.apply([(lo, torch.from_numpy(self.gradient(rank, lo, grad, values))) for lo, grad in grads])

    def updated(self, lo: int, hi: int, values: np.ndarray) -> None:
        """Slots [lo, hi) of `values` hold the update's result."""

    def sent(self, rank: int, values: np.ndarray) -> None:
        """`values` (whole, this version's) leave for worker `rank`."""

    def reply(self, values: np.ndarray, opt, version: int) -> np.ndarray:
        """What a reply to a push carries: the values, or a buffer derived from them."""
        return values

    def forget(self, rank: int | None = None) -> None:
        """Values sent to `rank` no longer describe its next push (it left, or a new worker
        took its rank); None: the shard's values were replaced (a restore), so nothing
        derived from them holds."""

    def detach(self) -> None:
        """Queued replies keep the buffers reply() returned: take fresh ones."""

    def state(self) -> dict:
        return {"staleness": self.staleness, "seen": self._seen}

    def arrays(self) -> dict[str, np.ndarray]:
        """What state() leaves out, as copies of shard-sized arrays (saved as "async.<name>")."""
        return {}

    def check_state(self, saved, arrays: dict, workers: int) -> None:
        """ValueError unless `saved` and `arrays` are state()'s and arrays()' of this
        correction at this size in a job of `workers` workers; `saved` None: a checkpoint
        written before corrections existed (or before they kept arrays), which must then
        hold none."""
        if saved is None:
            if arrays:
                raise ValueError(f"the saved shard holds correction arrays without their record: {sorted(arrays)}")
            return
        stale = saved.get("staleness") if isinstance(saved, dict) else None
        if not (type(stale) in (int, float) and math.isfinite(stale) and stale >= 0
                and type(saved.get("seen")) is int and saved["seen"] >= 0):
            raise ValueError("the saved shard's staleness record is malformed")
        self._check_arrays(saved, arrays, workers)

    def _check_arrays(self, saved: dict, arrays: dict, workers: int) -> None:
        if arrays:
            raise ValueError(f"the saved shard holds arrays the {type(self).__name__} correction does not keep: "
                             f"{sorted(arrays)}")

    def load_state(self, saved, arrays: dict) -> None:
        """Take state() and arrays() (checked by check_state); None starts afresh."""
        self.forget()
        self.staleness, self._seen = (0.0, 0) if saved is None else (float(saved["staleness"]), saved["seen"])


class _Remedy(Correction):
    """A correction at BSP's step per sample, lr * b_i / B, and the recipe's momentum."""

    def step(self, lr, share, opt):
        return lr * share, None


class MomentumCorrection(Correction):
    """Less momentum, and a learning rate that keeps most of the step BSP takes per sample.

    With N workers an update carries 1/N of a global batch: its learning rate is the
    recipe's * b_i / B (not b_i / b_ref). Lowering the momentum shortens the long-run
    step a slowly changing gradient gets (gain: SGD 1 / (1 - momentum), Adam 1 whatever
    beta1 is), and asynchrony gives none of it back: its implicit momentum only adds
    overshoot along a fast changing gradient. So the rate is raised to keep KEEP_STEP of
    the recipe's long-run step, never below b_i / B: all of it oscillates under delay,
    less learns slower (digits, 3 and 8 workers: benchmarks/results/asp_step.md)."""

    def step(self, lr, share, opt):
        recipe = opt.decay
        lowered = max(0.0, recipe - self.staleness / (1 + self.staleness))
        return lr * share * max(1.0, KEEP_STEP * opt.gain(recipe) / opt.gain(lowered)), lowered


class LookAhead(_Remedy):
    """Replies carry the values moved ahead: the look-ahead of one version, computed once
    and sent to every worker that pushed against it."""

    moves_replies = True

    def __init__(self, trained: int):
        super().__init__(trained)
        self._ahead = aligned_empty(0)
        self._version: int | None = None  # the version _ahead holds

    def reply(self, values, opt, version):
        if not (self.staleness and self.trained and opt.decay):  # nothing to look ahead along
            return values
        if self._version != version:
            if self._ahead.size != values.size:
                self._ahead = aligned_empty(values.size)
            t, decay = self.trained, opt.decay
            # a further update with no new gradient moves by decay * the last one's step, then decay^2 ...
            reach = decay * (1 - decay ** self.staleness) / (1 - decay)
            out = torch.from_numpy(self._ahead[:t])
            opt.direction(out)
            torch.sub(torch.from_numpy(values[:t]), out, alpha=reach, out=out)
            np.copyto(self._ahead[t:], values[t:])
            self._version = version
        return self._ahead

    def detach(self):
        self._ahead = aligned_empty(self._ahead.size)
        self._version = None

    def forget(self, rank=None):
        if rank is None:
            self._version = None


class Dana(_Remedy):
    """DANA-Zero (Hakimi et al. 2019) for SGD with momentum: a momentum buffer per worker.

    Worker i's update is the recipe's SGD step (momentum, Nesterov, weight decay) at its
    share of BSP's step per sample, eta_i = lr * b_i / B, on its own buffer v_i. Each
    buffer decays once per update of its own worker, so over a round in which every
    worker pushes once the values move as BSP's do with the recipe's momentum, instead of
    decaying N times a round as one shared buffer does (which, with the momentum
    asynchrony adds, overshoots). Workers compute their gradients at the look-ahead point
    x^ = x - momentum * sum_j eta_j * v_j: where the parameters x will be once every
    worker's momentum has taken its next step, so a gradient is computed about where it
    will be applied.

    The shard holds x^ itself, as torch's Nesterov SGD holds its look-ahead iterate, so
    replies, pulls and checkpoints carry it and an update is one pass: with the recipe's
    plain momentum, v_i = m v_i + g and x^ -= eta_i (g + m v_i), the fused Nesterov
    kernel; with --nesterov, x^ -= 2 eta_i g + (2m - 1) eta_i v_i. Weight decay is taken
    at x^, where the gradient was computed. A buffer is kept in parameter units (eta_i *
    v_i): when eta_i changes (the batch plan moved) v_i is rescaled first, so x^ stays
    consistent. A worker that leaves takes its buffer but not its pending momentum step:
    x^ stays as it is, as if that step were taken once.

    Adam's steps are normalised per value, and a buffer per worker would need its own
    normaliser: with Adam (and with SGD without momentum) the update is the momentum
    correction's. The buffers are part of the shard's checkpoint."""

    def __init__(self, trained: int):
        super().__init__(trained)
        self._v: dict[int, tuple[np.ndarray, float]] = {}  # rank -> (its buffer, the eta it last moved by)
        self._eta = 0.0  # this update's
        self._scale: float | None = None  # this update's rescale of its worker's buffer; None: not applied yet
        self._folded = aligned_empty(0)  # --nesterov with weight decay: the gradient with it, at x^

    def _moves(self, opt) -> bool:
        return isinstance(opt, SGD) and bool(opt.momentum)

    def step(self, lr, share, opt):
        if not self._moves(opt):
            return MomentumCorrection.step(self, lr, share, opt)  # (it reads only the staleness measured)
        self._eta, self._scale = lr * share, None
        return super().step(lr, share, opt)

    def apply(self, rank, grads, values, opt):
        if not (self.staleness and self._moves(opt)):  # no delay yet: the optimizer's own step, bit for bit
            return super().apply(rank, grads, values, opt)
        if self._scale is None:  # the update's first range (ready() writes one in several)
            v, eta = self._v.get(rank) or (aligned_zeros(self.trained), self._eta)
            self._scale = eta / self._eta
            self._v[rank] = (v, self._eta)
        buf, x = torch.from_numpy(self._v[rank][0]), torch.from_numpy(values)
        m, wd, eta = opt.momentum, opt.weight_decay, self._eta
        for lo, grad in grads:
            hi = lo + grad.size
            v, g = buf[lo:hi], torch.from_numpy(grad)
            if self._scale != 1:
                v.mul_(self._scale)
            if not opt.nesterov:
                fused_sgd(x[lo:hi], g, v, m, eta, wd, nesterov=True)
                continue
            if wd:  # every pass takes the same gradient: weight decay at x^ before it moves
                if self._folded.size != self.trained:
                    self._folded = aligned_empty(self.trained)
                g = torch.add(g, x[lo:hi], alpha=wd, out=torch.from_numpy(self._folded[lo:hi]))
            fused_sgd(x[lo:hi], g, v, m, (2 * m - 1) * eta, 0.0, nesterov=False)
            x[lo:hi].sub_(g, alpha=2 * eta)

    def forget(self, rank=None):
        if rank is None:
            self._v.clear()
        else:
            self._v.pop(rank, None)

    def state(self):
        # (per worker, the eta its buffer last moved the values by)
        return {**super().state(), "etas": {str(rank): eta for rank, (_, eta) in self._v.items()}}

    def arrays(self):
        return {f"v{rank}": v.copy() for rank, (v, _) in self._v.items()}

    def _check_arrays(self, saved, arrays, workers):
        etas = saved.get("etas", {})
        if not (isinstance(etas, dict) and all(k.isdigit() and type(e) in (int, float) and math.isfinite(e) and e > 0
                                               for k, e in etas.items())):
            raise ValueError("the saved shard's per-worker momentum record is malformed")
        if any(int(rank) >= workers for rank in etas):
            raise ValueError(f"the saved shard's per-worker momentum record names ranks {sorted(etas, key=int)}, "
                             f"the job has {workers} workers")
        if "sum" in arrays:
            raise ValueError("the saved shard holds dana's older form (the values x and their momentum sum "
                             "async.sum), which this omnips does not restore: it keeps the look-ahead values")
        names = {f"v{rank}" for rank in etas}
        if set(arrays) != names:
            raise ValueError(f"the saved shard's per-worker momentum buffers are {sorted(arrays)}, "
                             f"its record names {sorted(names)}")
        if any(a.dtype != np.float32 or a.shape != (self.trained,) for a in arrays.values()):
            raise ValueError(f"the saved per-worker momentum buffers are not {self.trained} float32 numbers")

    def load_state(self, saved, arrays):
        super().load_state(saved, arrays)
        for rank, eta in (saved or {}).get("etas", {}).items():
            v = aligned_empty(self.trained)
            np.copyto(v, arrays[f"v{rank}"])
            self._v[int(rank)] = (v, float(eta))


class _Gapped(_Remedy):
    """A correction from the gap between the values now and those sent to the pushing worker."""

    tracks_sent = True

    def __init__(self, trained: int):
        super().__init__(trained)
        self._sent: dict[int, np.ndarray] = {}
        self._out = aligned_empty(trained)  # the corrected gradient

    def sent(self, rank, values):
        copy = self._sent.get(rank)
        if copy is None:
            copy = self._sent[rank] = aligned_empty(self.trained)
        np.copyto(copy, values[:self.trained])

    def forget(self, rank=None):
        if rank is None:
            self._sent.clear()
            self._restart()
        else:
            self._sent.pop(rank, None)

    def _restart(self) -> None:
        """The shard's values were replaced: what was learnt of their movement goes too."""

    def gradient(self, rank, lo, grad, values):
        sent = self._sent.get(rank)
        if sent is None:  # its values came from a pull (a start, a join): no gap known
            return grad
        hi = lo + grad.size
        out = self._out[lo:hi]
        np.subtract(values[lo:hi], sent[lo:hi], out=out)
        return self._correct(lo, hi, grad, out)

    def _correct(self, lo, hi, grad, gap):
        raise NotImplementedError


class DelayCompensation(_Gapped):
    def _correct(self, lo, hi, grad, gap):
        gap *= grad
        gap *= grad
        gap *= DC_LAMBDA
        gap += grad
        return gap


class GapAware(_Gapped):
    def __init__(self, trained):
        super().__init__(trained)
        self._step = aligned_zeros(trained)  # mean |change| of each value per update
        self._before = aligned_empty(trained)

    def gradient(self, rank, lo, grad, values):
        np.copyto(self._before[lo:lo + grad.size], values[lo:lo + grad.size])
        return super().gradient(rank, lo, grad, values)

    def _correct(self, lo, hi, grad, gap):
        step = self._step[lo:hi]
        np.abs(gap, out=gap)
        np.divide(gap, step, out=gap, where=step > 0)  # values that never moved: no gap to speak of
        gap[step <= 0] = 1
        np.maximum(gap, 1, out=gap)
        np.divide(grad, gap, out=gap)
        return gap

    def _restart(self):
        self._step.fill(0)

    def updated(self, lo, hi, values):
        hi = min(hi, self.trained)
        if lo >= hi:
            return
        change = self._before[lo:hi]
        np.subtract(values[lo:hi], change, out=change)
        np.abs(change, out=change)
        weight = 1 / min(self._seen, GAP_SPAN)
        step = self._step[lo:hi]
        step *= 1 - weight
        step += weight * change


CORRECTIONS = {"dana": Dana, "none": Correction, "momentum": MomentumCorrection, "lookahead": LookAhead,
               "dc": DelayCompensation, "gap": GapAware}


def make(name: str, trained: int) -> Correction:
    return CORRECTIONS[name](trained)
