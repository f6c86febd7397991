"""A push applied from its parts as received (server/segments.py): the re-cut keeps every
value, and the step in segments is bit-for-bit the step on the joined gradient."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.server.segments import ALIGN, aligned

from shard_helpers import PEERS, make_core, parts_of, push


@st.composite
def tilings(draw):
    n = draw(st.integers(1, 700))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=12))) if n > 1 else []
    return n, cuts, draw(st.randoms(use_true_random=False))


@settings(max_examples=300, deadline=None)
@given(tilings())
def test_the_recut_tiles_the_same_values_with_aligned_inner_boundaries(tiling):
    n, cuts, rnd = tiling
    values = np.arange(n, dtype=np.float32)
    edges = [0, *cuts, n]
    segments = [(lo, values[lo:hi]) for lo, hi in zip(edges, edges[1:])]
    rnd.shuffle(segments)
    out = aligned(segments)
    assert [lo for lo, _ in out][0] == 0 and all(lo % ALIGN == 0 for lo, _ in out[1:])
    pos = 0
    for lo, v in out:
        assert lo == pos and v.size > 0
        np.testing.assert_array_equal(v, values[lo:lo + v.size])
        pos += v.size
    assert pos == n
    copied = sum(v.size for _, v in out if not np.shares_memory(v, values))
    assert copied <= ALIGN * len(cuts)  # only the windows around unaligned boundaries are copies


CASES = {  # mode, workers, optimizer, trained values (the rest: buffer slots)
    "bsp-mean": ("bsp", 3, "sgd", 1000), "bsp-one-gradient": ("bsp", 1, "sgd", 1000), "asp": ("asp", 3, "sgd", 1000),
    "asp-adam": ("asp", 3, "adam", 1000), "bsp-one-adam-buffers": ("bsp", 1, "adam", 700)}


@pytest.mark.parametrize("mode, workers, optimizer, trained", CASES.values(), ids=CASES.keys())
def test_steps_from_parts_at_odd_offsets_equal_the_steps_from_whole_pushes_bit_for_bit(mode, workers, optimizer,
                                                                                        trained):
    # weight decay: the fused kernels round a vector block and an array's last few values
    # differently, so unaligned parts would change last bits
    n, rng = 1000, np.random.default_rng(3)
    init = rng.standard_normal(n).astype(np.float32)
    cores = [make_core(mode, n=n, num_trained=trained, num_workers=workers, init=init, weight_decay=0.01,
                       optimizer=optimizer) for _ in range(2)]
    whole, parted = cores
    for step in range(4):
        for rank in range(workers):
            g = rng.standard_normal(n).astype(np.float32)
            whole.handle(PEERS[rank], push(rank, step, g, batch=rank + 3, version=0), 1.0)
            for part in reversed(parts_of(g, [7, 333, 334, 701], rank=rank, step=step, batch=rank + 3)):
                parted.handle(PEERS[rank], part, 1.0)
    assert parted.version == whole.version > 0 and parted.parts_joined == 4 * workers
    np.testing.assert_array_equal(parted.values, whole.values)
    for name, buffer in whole.store.opt.state()[1].items():
        np.testing.assert_array_equal(parted.store.opt.state()[1][name], buffer)
