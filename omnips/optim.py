"""Server-side optimizers on a flat shard: torch.optim's update rules, in place.

A step is `begin(lr)`, once, then `apply(segments)` for (offset, values) segments of
the gradient, in one call or several, in any order, until they tile the parameter:
a push that came in parts is applied from the parts as they were received, without
joining them into one buffer first, and a server writes the step range by range as
it sends the replies that carry it. Every update rule is elementwise, so a step in
segments whose boundaries are multiples of server/segments.py's ALIGN is bit-for-bit
the step on the joined gradient.

Both give bit-for-bit the results of torch.optim.SGD and torch.optim.Adam with
their default CPU settings, so BSP training equals single-process training with
torch's optimizers (tests/test_cluster.py, tests/test_optim.py). They are not
torch.optim objects because constructing one imports torch._dynamo, 3.5 s of
start-up per server process here, and so that each shard's temporaries are
allocated once instead of per step.
"""

import numpy as np
import torch

from .job import JobSpec


def fused_sgd(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, momentum: float, lr: float,
              weight_decay: float, nesterov: bool, first: bool = False) -> None:
    """One pass of torch's fused SGD kernel (the one behind torch.optim.SGD(fused=True))
    over `param`, its gradient and its momentum buffer (None: none, at momentum 0)."""
    torch._fused_sgd_([param], [grad], [] if buf is None else [buf], weight_decay=weight_decay, momentum=momentum,
                      lr=lr, dampening=0.0, nesterov=nesterov, maximize=False, is_first_step=first)


class SGD:
    """SGD with momentum (dampening 0), Nesterov and L2 weight decay.

    One pass over memory with torch's fused kernel (the one behind
    torch.optim.SGD(fused=True)): 11.6 ms for 11M values against 17.4 ms for the
    three separate in-place ops, and bit-for-bit the same result.
    """

    def __init__(self, param: torch.Tensor, momentum: float, nesterov: bool, weight_decay: float):
        self.param, self.momentum, self.nesterov, self.weight_decay = param, momentum, nesterov, weight_decay
        self.buf = torch.zeros_like(param) if momentum else None
        self._first = True
        self._lr, self._first_now, self._momentum = 0.0, True, momentum  # the current step's
        self._stepped = False  # a step was taken since the optimizer was made or restored

    @property
    def decay(self) -> float:
        """The momentum, as every optimizer names the factor its running average decays by."""
        return self.momentum

    @staticmethod
    def gain(decay: float) -> float:
        """How far a constant unit gradient moves a value per step in the long run, / lr."""
        return 1 / (1 - decay)

    def begin(self, lr: float, decay: float | None = None) -> None:
        """A step at `lr`, with momentum `decay` instead of the recipe's (an asynchronous
        correction: server/asynchrony.py)."""
        self._lr, self._first_now, self._first = lr, self._first, False
        self._momentum = self.momentum if decay is None else decay
        self._stepped = True

    def apply(self, grads: list[tuple[int, torch.Tensor]]) -> None:
        for lo, grad in grads:
            hi = lo + grad.numel()
            buffered = self.momentum and self._momentum  # the kernel takes no buffer at momentum 0
            if self.momentum and not buffered:  # what the buffer holds after a step at momentum 0
                torch.add(grad, self.param[lo:hi], alpha=self.weight_decay, out=self.buf[lo:hi])
            fused_sgd(self.param[lo:hi], grad, self.buf[lo:hi] if buffered else None, self._momentum, self._lr,
                      self.weight_decay, self.nesterov, first=self._first_now)

    def direction(self, out: torch.Tensor) -> None:
        """The last step's change of each value, less its sign: lr * the momentum buffer (0
        before a first step since the optimizer was made or restored)."""
        if self._stepped:
            torch.mul(self.buf, self._lr, out=out)
        else:
            out.zero_()

    def state(self) -> tuple[dict, dict]:
        """(scalars, buffers): what the next steps depend on besides the parameter."""
        return {"first": self._first}, ({"momentum_buffer": self.buf.numpy().copy()} if self.momentum else {})

    def load_state(self, scalars: dict, buffers: dict) -> None:
        """Take state() of an optimizer of the same settings and size; changes nothing on a refusal."""
        _check_state(self.param, scalars, {"first": bool}, buffers, ["momentum_buffer"] if self.momentum else [])
        self._first = scalars["first"]
        self._stepped = False
        if self.momentum:
            self.buf.copy_(torch.from_numpy(buffers["momentum_buffer"]))


class Adam:
    """Adam with L2 weight decay (torch.optim.Adam, amsgrad off)."""

    def __init__(self, param: torch.Tensor, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        self.param, self.betas, self.eps, self.weight_decay = param, betas, eps, weight_decay
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        self._denom = torch.empty_like(param)  # the last step's, once _stepped
        self._tmp = torch.empty_like(param) if weight_decay else None
        self.steps = 0
        self._step_size, self._bias_correction2_sqrt, self._beta1 = 0.0, 1.0, betas[0]  # the current step's
        self._stepped = False  # a step was taken since the optimizer was made or restored

    @property
    def decay(self) -> float:
        return self.betas[0]

    @staticmethod
    def gain(decay: float) -> float:
        """How far a constant gradient moves a value per step in the long run, / lr: Adam's
        steps are normalised, whatever beta1 is."""
        return 1.0

    def begin(self, lr: float, decay: float | None = None) -> None:
        """A step at `lr`, with beta1 `decay` instead of the recipe's (an asynchronous
        correction: server/asynchrony.py; its bias correction then takes decay ** steps)."""
        beta1, beta2 = self.betas
        self._beta1 = beta1 if decay is None else decay
        self.steps += 1
        self._step_size = lr / (1 - self._beta1 ** self.steps)
        self._bias_correction2_sqrt = (1 - beta2 ** self.steps) ** 0.5
        self._stepped = True  # (apply() writes _denom before anything reads it)

    def apply(self, grads: list[tuple[int, torch.Tensor]]) -> None:
        beta1, beta2 = self._beta1, self.betas[1]
        for lo, grad in grads:
            hi = lo + grad.numel()
            param, exp_avg, exp_avg_sq = self.param[lo:hi], self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi]
            if self.weight_decay:
                grad = torch.add(grad, param, alpha=self.weight_decay, out=self._tmp[lo:hi])
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = torch.sqrt(exp_avg_sq, out=self._denom[lo:hi]).div_(self._bias_correction2_sqrt).add_(self.eps)
            param.addcdiv_(exp_avg, denom, value=-self._step_size)

    def direction(self, out: torch.Tensor) -> None:
        """The last step's change of each value, less its sign (0 before a first step
        since the optimizer was made or restored)."""
        if not self._stepped:
            out.zero_()
            return
        torch.div(self.exp_avg, self._denom, out=out).mul_(self._step_size)

    def state(self) -> tuple[dict, dict]:
        return {"steps": self.steps}, {"exp_avg": self.exp_avg.numpy().copy(),
                                       "exp_avg_sq": self.exp_avg_sq.numpy().copy()}

    def load_state(self, scalars: dict, buffers: dict) -> None:
        _check_state(self.param, scalars, {"steps": int}, buffers, ["exp_avg", "exp_avg_sq"])
        self.steps = scalars["steps"]
        self._stepped = False
        self.exp_avg.copy_(torch.from_numpy(buffers["exp_avg"]))
        self.exp_avg_sq.copy_(torch.from_numpy(buffers["exp_avg_sq"]))


def _check_state(param: torch.Tensor, scalars: dict, scalar_types: dict, buffers: dict, names: list) -> None:
    if scalars.keys() != scalar_types.keys() or buffers.keys() != set(names):
        raise ValueError(f"optimizer state holds {sorted(scalars)} and {sorted(buffers)}, "
                         f"this optimizer needs {sorted(scalar_types)} and {sorted(names)}")
    for key, tp in scalar_types.items():
        value = scalars[key]
        if type(value) is not tp or (tp is int and value < 0):
            raise ValueError(f"optimizer state {key!r} is {value!r}, not a {tp.__name__}")
    for name in names:
        b = buffers[name]
        if not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.shape != tuple(param.shape):
            raise ValueError(f"optimizer buffer {name!r} is not {param.numel()} float32 values")


def make(job: JobSpec, param: torch.Tensor):
    if job.optimizer == "sgd":
        return SGD(param, job.momentum, job.nesterov, job.weight_decay)
    if job.optimizer == "adam":
        return Adam(param, weight_decay=job.weight_decay)
    raise ValueError(f"unknown optimizer {job.optimizer!r}")
