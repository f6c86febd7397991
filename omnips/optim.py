"""Server-side optimizers on a flat shard: torch.optim's update rules, in place.

These follow torch.optim.SGD and torch.optim.Adam (the single-tensor CPU code
paths) operation for operation, so BSP training equals single-process training
with torch's optimizers (tests/test_cluster.py, tests/test_optim.py). They are
written out rather than borrowed because constructing a torch.optim optimizer
imports torch._dynamo, 3.5 s of start-up per server process here, and because
the temporaries can be preallocated once per shard instead of per step.
"""

import torch

from .job import JobSpec


class SGD:
    """SGD with momentum (dampening 0), Nesterov and L2 weight decay."""

    def __init__(self, param: torch.Tensor, momentum: float, nesterov: bool, weight_decay: float):
        self.param, self.momentum, self.nesterov, self.weight_decay = param, momentum, nesterov, weight_decay
        self.buf = torch.zeros_like(param) if momentum else None
        self._started = False
        self._tmp = torch.empty_like(param) if (weight_decay or nesterov) else None

    def step(self, grad: torch.Tensor, lr: float) -> None:
        d_p = grad
        if self.weight_decay:
            d_p = torch.add(grad, self.param, alpha=self.weight_decay, out=self._tmp)
        if self.momentum:
            if self._started:
                self.buf.mul_(self.momentum).add_(d_p)
            else:
                self.buf.copy_(d_p)
                self._started = True
            if self.nesterov:
                d_p = torch.add(d_p, self.buf, alpha=self.momentum, out=self._tmp)
            else:
                d_p = self.buf
        self.param.add_(d_p, alpha=-lr)


class Adam:
    """Adam with L2 weight decay (torch.optim.Adam, amsgrad off)."""

    def __init__(self, param: torch.Tensor, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        self.param, self.betas, self.eps, self.weight_decay = param, betas, eps, weight_decay
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        self._denom = torch.empty_like(param)
        self._tmp = torch.empty_like(param) if weight_decay else None
        self.steps = 0

    def step(self, grad: torch.Tensor, lr: float) -> None:
        beta1, beta2 = self.betas
        self.steps += 1
        if self.weight_decay:
            grad = torch.add(grad, self.param, alpha=self.weight_decay, out=self._tmp)
        self.exp_avg.lerp_(grad, 1 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = lr / (1 - beta1 ** self.steps)
        bias_correction2_sqrt = (1 - beta2 ** self.steps) ** 0.5
        denom = torch.sqrt(self.exp_avg_sq, out=self._denom).div_(bias_correction2_sqrt).add_(self.eps)
        self.param.addcdiv_(self.exp_avg, denom, value=-step_size)


def make(job: JobSpec, param: torch.Tensor):
    if job.optimizer == "sgd":
        return SGD(param, job.momentum, job.nesterov, job.weight_decay)
    if job.optimizer == "adam":
        return Adam(param, weight_decay=job.weight_decay)
    raise ValueError(f"unknown optimizer {job.optimizer!r}")
