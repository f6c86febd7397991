"""Flat, page-aligned float32 buffers that a model's parameters and gradients live in.

A shard is then a zero-copy slice, a push is a view of the gradient buffer and a
pull writes straight into the parameter buffer. Page alignment keeps loopback TCP
copies fast (docs/performance.md).
"""

import mmap

import numpy as np
import torch

PAGE = mmap.PAGESIZE


def aligned_empty(n: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised 1-D array of `n` items whose data starts on a page boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + PAGE, dtype=np.uint8)
    offset = (-raw.ctypes.data) % PAGE
    return raw[offset:offset + n * dtype.itemsize].view(dtype)


def aligned_zeros(n: int, dtype=np.float32) -> np.ndarray:
    out = aligned_empty(n, dtype)
    out.fill(0)
    return out


class FlatModel:
    """Re-homes a module's parameters and floating-point buffers into one flat vector.

    Layout: parameters in `named_parameters()` order, then floating-point buffers in
    `named_buffers()` order. Buffers (e.g. BatchNorm statistics) are not trained: in
    a push their slots carry the worker's current values, and servers average them
    by batch instead of applying the optimizer (see server/shard.py).

    `params` and `grads` are the host (numpy) buffers that travel on the wire. On a
    CPU device the model's tensors are views of them; on CUDA the model lives in
    device buffers and `load_params` / `finish_grads` copy between the two.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.module = module.to(self.device)
        params = [p for p in self.module.parameters() if p.requires_grad]
        bad = [p.dtype for p in params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"parameters must be float32, found {bad[0]}")
        buffers: dict[int, tuple[torch.Tensor, list]] = {}  # a buffer two modules share: one place, one view
        for owner in self.module.modules():
            for name, b in owner._buffers.items():
                if b is not None and b.is_floating_point():
                    buffers.setdefault(id(b), (b, []))[1].append((owner, name))
        self.num_trained = sum(p.numel() for p in params)
        self.size = self.num_trained + sum(b.numel() for b, _ in buffers.values())
        self.params = aligned_empty(self.size)
        self.grads = aligned_zeros(self.size)
        self._host_p = torch.from_numpy(self.params)
        self._host_g = torch.from_numpy(self.grads)
        if self.device.type == "cpu":
            self._dev_p, self._dev_g = self._host_p, self._host_g
        else:
            self._dev_p = torch.empty(self.size, dtype=torch.float32, device=self.device)
            self._dev_g = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        self._grad_views = []
        self.spans = []  # each trained parameter's [lo, hi) in the flat vector
        pos = 0
        for p in params:
            n = p.numel()
            view = self._dev_p[pos:pos + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.grad = self._dev_g[pos:pos + n].view_as(p)
            self._grad_views.append((p, p.grad))
            self.spans.append((pos, pos + n))
            pos += n
        self.places = {id(p): span for p, span in zip(params, self.spans)}  # tensor -> its [lo, hi)
        for b, owners in buffers.values():
            n = b.numel()
            view = self._dev_p[pos:pos + n].view_as(b)
            view.copy_(b.to(torch.float32))
            for owner, name in owners:
                owner._buffers[name] = view
            self.places[id(view)] = (pos, pos + n)
            pos += n
        if self._dev_p is not self._host_p:
            self._host_p.copy_(self._dev_p)

    def zero_grads(self) -> None:
        self._dev_g.zero_()

    @property
    def trained(self) -> list[torch.nn.Parameter]:
        """The trained parameters, in the flat vector's order."""
        return [p for p, _ in self._grad_views]

    def reach(self, module: torch.nn.Module) -> tuple[int, int] | None:
        """The part of the flat vector holding `module`'s own parameters and buffers
        (not its children's), or None when it has none there."""
        spans = [self.places[id(t)] for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
                 if id(t) in self.places]
        return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None

    def settle(self, i: int) -> None:
        """Make trained parameter i's gradient live in its slot of the flat gradient."""
        p, view = self._grad_views[i]
        if p.grad is None:  # unused this step (set to None by the user): zero
            view.zero_()
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            # autograd replaced the tensor (e.g. a non-contiguous gradient): copy it home
            view.copy_(p.grad)
            p.grad = view

    def load_params(self) -> None:
        """Make the model see what was written into the host `params` buffer."""
        if self._dev_p is not self._host_p:
            self._dev_p.copy_(self._host_p)

    def finish_grads(self) -> None:
        """After backward: gather every gradient into the host `grads` buffer, with
        the buffers' current values in their slots."""
        for i in range(len(self._grad_views)):
            self.settle(i)
        nt = self.num_trained
        self._dev_g[nt:].copy_(self._dev_p[nt:])
        if self._dev_g is not self._host_g:
            self._host_g.copy_(self._dev_g)


FLOAT32_MAX = float(np.finfo(np.float32).max)


def square_sum(data: np.ndarray) -> float:
    """The sum of squares, in data's dtype: inf or nan when a value is not finite or it
    overflows. One BLAS dot (4 ms for 44 MB here) instead of isfinite's temporary mask (65 ms)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is the answer, not an error
        return float(np.dot(data, data)) if data.size else 0.0


def all_finite(data: np.ndarray) -> bool:
    """True when every value is finite and the sum of squares does not overflow float32
    (sums of parts' square_sum are judged alike: finite and at most FLOAT32_MAX)."""
    return square_sum(data) <= FLOAT32_MAX
