"""Server-side optimizers: torch's own, applied to a shard as one flat parameter.

Using torch.optim on the shard gives exactly torch's update rules (momentum,
Nesterov, weight decay, Adam's bias correction), which is what makes BSP training
equal single-process training. The shard tensor shares memory with the server's
numpy buffer, so updates happen in place.
"""

import torch

from .job import JobSpec


def make(job: JobSpec, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    if job.optimizer == "sgd":
        return torch.optim.SGD([param], lr=job.lr, momentum=job.momentum, nesterov=job.nesterov,
                               weight_decay=job.weight_decay)
    if job.optimizer == "adam":
        return torch.optim.Adam([param], lr=job.lr, weight_decay=job.weight_decay)
    raise ValueError(f"unknown optimizer {job.optimizer!r}")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr
