"""Memory awareness: the per-sample footprint probe, free memory, and the batch bound from them."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from omnips import data, models
from omnips.batching import BACKWARD_FACTOR, MEMORY_USE, memory_batch
from omnips.worker import memory

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def train():
    return data.load("digits", {})[0]


def _probe(train, name="mlp", args=None):
    model = models.build(name, args or {}, train, 0)
    return model, memory.sample_bytes(model, data.Batcher(train), range(len(train)), CPU)


@pytest.mark.parametrize("hidden", [(128, 64), (256, 64), (32,)])
def test_mlp_footprint_is_the_activations_autograd_keeps(train, hidden):
    _, got = _probe(train, "mlp", {"hidden": list(hidden)})
    # per sample: the 64 inputs, each hidden ReLU output (shared with the next layer's
    # input), the 10 log-probabilities, all float32, and the int64 label
    assert got == 4 * (64 + sum(hidden) + 10) + 8


def test_footprint_grows_with_the_model_and_the_probe_leaves_no_trace(train):
    model, mlp = _probe(train)
    _, cnn = _probe(train, "cnn")
    assert cnn > 4 * mlp  # convolution maps per sample outweigh the mlp's vectors
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    memory.sample_bytes(model, data.Batcher(train), range(len(train)), CPU)
    assert torch.equal(torch.rand(4), expected)  # dropout masks of the real steps do not shift
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_probe_needs_enough_samples(train):
    model = models.build("mlp", {}, train, 0)
    with pytest.raises(ValueError, match="probe needs 4 samples"):
        memory.sample_bytes(model, data.Batcher(train), range(3), CPU)


def test_available_ram_reads_meminfo(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    assert memory.available_ram(str(f)) == 20000000 * 1024


def test_available_ram_without_meminfo_counts_free_pages(tmp_path):
    got = memory.available_ram(str(tmp_path / "absent"))
    assert 0 < got <= memory.available_ram() * 2


def test_free_cuda_memory_counts_the_allocators_cached_blocks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000, 8000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 600)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 250)
    assert memory.free_bytes(torch.device("cuda", 0)) == 1000 + 600 - 250


def test_memory_batch_arithmetic():
    per = 1000
    assert memory_batch(100_000, per) == int(MEMORY_USE * 100_000 // (BACKWARD_FACTOR * per))
    assert memory_batch(100_000, per, sharing=4) == int(MEMORY_USE * 25_000 // (BACKWARD_FACTOR * per))
    assert memory_batch(100_000, per, limit=10_000) == int(MEMORY_USE * 10_000 // (BACKWARD_FACTOR * per))
    assert memory_batch(100_000, per, sharing=4, limit=50_000) == memory_batch(100_000, per, sharing=4)
    assert memory_batch(0, per) == 0


@pytest.mark.parametrize("free,per,sharing,limit", [(-1, 1, 1, 0), (1, 0, 1, 0), (1, 1, 0, 0), (1, 1, 1, -1)])
def test_memory_batch_refuses_nonsense(free, per, sharing, limit):
    with pytest.raises(ValueError):
        memory_batch(free, per, sharing, limit)


@given(st.integers(0, 2**44), st.integers(1, 2**30), st.integers(1, 64), st.integers(0, 2**44))
def test_memory_batch_fits_and_is_the_largest_that_does(free, per, sharing, limit):
    b = memory_batch(free, per, sharing, limit)
    usable = min(free / sharing, limit) if limit else free / sharing
    assert b >= 0
    assert b * BACKWARD_FACTOR * per <= MEMORY_USE * usable * (1 + 1e-12)
    assert (b + 1) * BACKWARD_FACTOR * per > MEMORY_USE * usable * (1 - 1e-12)


def test_memory_batch_falls_as_workers_share_a_device():
    got = [memory_batch(10**9, 4096, sharing=k) for k in range(1, 9)]
    assert got == sorted(got, reverse=True) and got[0] >= 7 * got[7]
    assert np.all(np.diff(got) <= 0)


def _fresh_process(script: str, mode: str, skip: str) -> list[str]:
    """What `script` prints, run with `mode` in a process of its own (an allocator is set once,
    before its first large block); skipped where it fails (not glibc)."""
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=60)
    if out.returncode:
        pytest.skip(f"{skip}: {out.stderr.strip().splitlines()[-1]}")
    return out.stdout.split()


REUSE = """
import ctypes, sys
import numpy as np
from omnips.worker import memory

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
kept = memory.keep_freed_memory() if sys.argv[1] == "keep" else None
a = np.empty(12 << 20, dtype=np.float32)  # a step's 48 MiB tensor
mapped = mallinfo2().hblkhd  # bytes in blocks mapped on their own
del a
print(kept, mapped, mallinfo2().fordblks)  # and bytes freed but kept
"""


@pytest.mark.cluster
def test_a_step_s_freed_memory_is_kept_for_the_next_instead_of_mapped_again():
    """By default glibc maps a 48 MiB block on its own and unmaps it when freed (the next step's
    pages are zeroed by the kernel again); kept, it comes from the heap and stays there, free."""
    def run(mode):
        kept, mapped, free = _fresh_process(REUSE, mode, "no glibc mallinfo2 here")
        return kept, int(mapped), int(free)

    block = 48 << 20
    kept, mapped, free = run("keep")
    assert kept == "True" and mapped < block and free >= block
    _, mapped, free = run("default")
    assert mapped >= block and free < block


WARM = """
import resource, sys
import torch
from omnips.worker import memory

assert memory.keep_freed_memory()
warmed = memory.warm_heap(32 << 20) if sys.argv[1] == "warm" else 0
junk = [bytes(100) for _ in range(1000)]  # the heap's small blocks meanwhile
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = torch.ones(12 << 20)  # a later step's 48 MiB tensor, past the heap's end so far
print(warmed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.cluster
def test_a_warmed_heap_gives_a_later_step_s_new_tensor_pages_the_kernel_need_not_fault_in():
    """A step whose tensors outgrow the heap faults every new page in, in the step (under a CPU
    quota such steps ran 2-5x); warmed beforehand (a worker does it in a step at a larger batch),
    the heap's growth is already there."""
    def run(mode):
        return tuple(map(int, _fresh_process(WARM, mode, "not glibc's allocator here")))

    pages = (48 << 20) // 4096
    warmed, faults = run("warm")
    assert warmed == memory.WARM_STEPS * (32 << 20) and faults < pages // 10
    _, faults = run("cold")
    assert faults > pages * 9 // 10
