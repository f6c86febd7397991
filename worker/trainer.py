"""A worker's compute phase: gather a batch, forward, backward, gradients into the flat buffer."""

import logging
import time

import torch

from omnips import models
from omnips.data import Batcher
from omnips.flat import FlatModel

log = logging.getLogger("omnips.worker")


def resolve_device(spec: str) -> torch.device:
    """'auto' picks CUDA when present; an unusable CUDA request is an error, not a fallback."""
    device = check_device(spec)
    if device.type == "cuda" and device.index is None:  # named in full: the scheduler tells workers sharing one GPU by it
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_device(spec: str) -> torch.device:
    """`spec` as a device this machine has (ValueError if not), CUDA left uninitialised: a
    launcher checks its workers' devices without holding one itself."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
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


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


class Trainer:
    """Computes a step's gradient, in chunks when the batch does not fit in memory.

    The gradient of the mean loss over b samples is the chunks' mean-loss gradients
    weighted by chunk size / b, so a step done in chunks is the same step. An
    out-of-memory error halves the chunk and redoes the step; `max_batch` then
    tells the scheduler how much this worker can hold (and `limit` caps it up front).
    """

    def __init__(self, flat: FlatModel, batcher: Batcher, max_batch: int = 0, fault_oom_above: int = 0):
        self.flat = flat
        self.batcher = batcher
        self.max_batch = max_batch  # 0: no known limit
        self._fault_oom_above = fault_oom_above  # test knob: emulate OOM for larger chunks
        self._cuda = flat.device.type == "cuda"
        # the worker's pusher: told before the backward that makes the gradients final (its hooks
        # then send them as they come), and before a step is computed again (what was sent must be out)
        self.on_final_pass = None
        self.on_retry = None

    def compute(self, indices, poison: bool = False) -> tuple[float, float]:
        """Gradients of the mean loss over `indices` into flat.grads: (loss, seconds).
        `poison` (a test knob) makes the loss, and so every gradient, NaN."""
        start = time.perf_counter()
        while True:
            chunk = self.max_batch or len(indices)
            try:
                loss = self._gradients(indices, chunk, poison)
                break
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                if chunk <= 1:
                    raise MemoryError("out of memory with a single sample per pass") from None
                self.max_batch = max(1, min(chunk, len(indices)) // 2)
                log.warning("out of memory with %d samples per pass: retrying with %d", chunk, self.max_batch)
                if self._cuda:
                    torch.cuda.empty_cache()
                if self.on_retry is not None:
                    self.on_retry()
        return loss, time.perf_counter() - start

    def _gradients(self, indices, chunk: int, poison: bool) -> float:
        self.flat.zero_grads()
        total = 0.0
        for lo in range(0, len(indices), chunk):
            part = indices[lo:lo + chunk]
            if self._fault_oom_above and len(part) > self._fault_oom_above:
                raise torch.OutOfMemoryError(f"emulated: {len(part)} samples > --fault-oom-above")
            x, y = self.batcher(part)
            x, y = x.to(self.flat.device, non_blocking=True), y.to(self.flat.device, non_blocking=True)
            loss = models.loss_fn(self.flat.module(x), y) * (len(part) / len(indices))
            if poison:
                loss = loss * float("nan")
            if self.on_final_pass is not None and lo + chunk >= len(indices):
                self.on_final_pass()
            loss.backward()
            total += loss.item()
        self.flat.finish_grads()
        if self._cuda:
            torch.cuda.synchronize(self.flat.device)
        return total
