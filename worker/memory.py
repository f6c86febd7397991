"""What a worker measures of its memory: the bytes it can use now, and what one sample costs.

The scheduler turns the two into a batch bound (omnips.batching.memory_batch); an
out-of-memory error in a step remains the backstop (worker/trainer.py).
"""

import ctypes
import os

import torch

from omnips import models
from omnips.batching import PROBE_BATCHES
from omnips.data import Batcher

MEMINFO = "/proc/meminfo"
# glibc's mallopt parameters: blocks up to KEEP_BYTES come from the heap, and up to as much freed at its top stays
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BYTES = 1 << 30
# the heap a worker warms for a larger batch, in steps of it (see warm_heap): the step itself takes about
# one. Four workers without quotas, 100 steps each, grew their heaps mid-step (by 9 MiB) once with two;
# with four, never in two runs warming whole batches, once in one run warming only the samples added.
# Under CPU quotas beside other jobs, two stalled HL8's workers twice mid-run (3.7x and 7.2x steps) where
# four did not, for a start 2.5-4 s shorter (benchmarks/results/cgroup-ab-warm-steps.md)
WARM_STEPS = 4


def keep_freed_memory() -> bool:
    """Have the C allocator keep what a step frees for the next step; whether it could (glibc only).

    By default glibc maps each block over its mmap threshold (at most 32 MiB however it adapts)
    afresh and unmaps it when freed, and gives the heap's freed top back to the kernel: a CPU
    step whose tensors pass that size pays the kernel to zero every one of their pages again, each
    step (benchmarks/malloc.py measures it). A step's tensors are the same from one step to the
    next, so its memory is kept instead; on a CPU, free_bytes then counts what the process keeps
    as used (a bound on the batch on the safe side)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library of that kind (not glibc)
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))


def warm_heap(step_bytes: int) -> int:
    """Zero-fill WARM_STEPS steps of `step_bytes` on the heap and free them; the bytes warmed.
    A worker calls it in each step at a batch larger than any before, for the samples added,
    once keep_freed_memory succeeded.

    Kept memory is not enough: the heap still grows now and then, a step's tensors finding no
    freed block large enough among what the others' allocations left in between, and the new
    pages are the kernel's to zero, in that step. On a worker under a CPU quota such a step ran
    2-5x its others (9-40 MiB of new heap: thousands of page faults, all of the quota's time),
    and dynamic batching took it for a change of speed. Freed with the heap's top kept, the
    warmed pages are where the heap grows next. At most a sixteenth of the available RAM (a
    worker shares its host) and half of KEEP_BYTES (a freed top above that would be trimmed)."""
    size = max(0, min(WARM_STEPS * step_bytes, KEEP_BYTES // 2, available_ram() // 16))
    torch.zeros(size, dtype=torch.uint8)  # (written, so every page is faulted in now; freed at once)
    return size


def free_bytes(device: torch.device) -> int:
    """Memory a step could fill now: free device memory plus the allocator's cached free
    blocks on CUDA, available RAM on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return available_ram()


def available_ram(meminfo: str = MEMINFO) -> int:
    """The kernel's estimate of memory available without swapping (MemAvailable), or the
    free pages where /proc/meminfo has no such line (an underestimate: no page cache)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sample_bytes(module: torch.nn.Module, batcher: Batcher, indices, device: torch.device) -> int:
    """Bytes autograd keeps for backward per sample: the tensors saved in forward passes
    of PROBE_BATCHES[0] and [1] samples, counted once per storage, their difference per
    sample. Weights saved for backward cancel out; the random state is left as it was
    (a probe must not shift dropout masks), and the gradients it leaves are discarded
    by the next step's zeroing."""
    small, large = PROBE_BATCHES
    if len(indices) < large:
        raise ValueError(f"the memory probe needs {large} samples, the data set has {len(indices)}")
    sizes = [_saved_bytes(module, batcher, indices[:k], device) for k in PROBE_BATCHES]
    return max(1, (sizes[1] - sizes[0]) // (large - small))


def _saved_bytes(module, batcher, indices, device) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    x, y = batcher(indices)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = models.loss_fn(module(x.to(device)), y.to(device))
        loss.backward()
    return sum(storages.values())
