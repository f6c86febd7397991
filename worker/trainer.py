"""A worker's compute phase: gather a batch, forward, backward, gradients into the flat buffer."""

import time

import torch

from omnips import models
from omnips.data import Batcher
from omnips.flat import FlatModel


def resolve_device(spec: str) -> torch.device:
    """'auto' picks CUDA when present; an unusable CUDA request is an error, not a fallback."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"unknown device {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but this machine has no usable CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif device.type != "cpu":
        raise ValueError(f"unsupported device {spec!r}: use auto, cpu, cuda or cuda:N")
    return device


class Trainer:
    def __init__(self, flat: FlatModel, batcher: Batcher):
        self.flat = flat
        self.batcher = batcher
        self._cuda = flat.device.type == "cuda"

    def compute(self, indices) -> tuple[float, float]:
        """Gradients of the mean loss over `indices` into flat.grads: (loss, seconds)."""
        start = time.perf_counter()
        x, y = self.batcher(indices)
        x, y = x.to(self.flat.device, non_blocking=True), y.to(self.flat.device, non_blocking=True)
        self.flat.zero_grads()
        loss = models.loss_fn(self.flat.module(x), y)
        loss.backward()
        self.flat.finish_grads()
        if self._cuda:
            torch.cuda.synchronize(self.flat.device)
        value = loss.item()
        return value, time.perf_counter() - start
