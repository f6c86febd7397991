"""Sample streams: exact epochs in BSP for any (changing) mix of batch sizes; ASP streams per rank."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.data import SampleStream, bsp_slice_start
from omnips.job import JobSpec

FAST = settings(max_examples=40, deadline=None)


@st.composite
def batch_vector(draw, num_workers: int, global_batch: int) -> list[int]:
    """num_workers positive ints summing to global_batch (any split, uniform or not)."""
    cuts = draw(st.lists(st.integers(1, global_batch - 1), min_size=num_workers - 1,
                         max_size=num_workers - 1, unique=True)) if num_workers > 1 else []
    edges = [0, *sorted(cuts), global_batch]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def bsp_run(draw):
    n = draw(st.integers(1, 60))
    num_workers = draw(st.integers(1, 6))
    global_batch = draw(st.integers(num_workers, 40))
    epochs = draw(st.integers(1, 3))
    steps = -(-epochs * n // global_batch) + draw(st.integers(0, 2))
    vectors = [draw(batch_vector(num_workers, global_batch)) for _ in range(steps)]
    seed = draw(st.integers(0, 2**32))
    return n, global_batch, vectors, seed


@FAST
@given(run=bsp_run())
def test_bsp_steps_cover_every_sample_once_per_epoch(run):
    n, global_batch, vectors, seed = run
    num_workers = len(vectors[0])
    streams = [SampleStream(n, seed) for _ in range(num_workers)]  # one per worker process
    total = len(vectors) * global_batch
    index_at = np.full(total, -1, dtype=np.int64)
    for step, batches in enumerate(vectors):
        assert sum(batches) == global_batch and min(batches) >= 1
        covered = []
        for rank, b in enumerate(batches):
            start = bsp_slice_start(step * global_batch, batches, rank)
            indices = streams[rank].take(start, b)
            assert len(indices) == b
            positions = np.arange(start, start + b)
            assert np.all(index_at[positions] == -1), "a stream position was handed out twice"
            index_at[positions] = indices
            covered.extend(positions.tolist())
        # the workers' slices tile exactly this step's positions
        assert sorted(covered) == list(range(step * global_batch, (step + 1) * global_batch))
    assert np.all(index_at >= 0)
    for e in range(total // n):  # every whole epoch is a permutation of the dataset
        assert sorted(index_at[e * n:(e + 1) * n].tolist()) == list(range(n))
    # and it is the same global stream whatever the batch vectors were
    np.testing.assert_array_equal(index_at, SampleStream(n, seed).take(0, total))


def test_bsp_slice_start_examples():
    assert bsp_slice_start(0, [5, 7, 20], 0) == 0
    assert bsp_slice_start(0, [5, 7, 20], 1) == 5
    assert bsp_slice_start(64, [5, 7, 20], 2) == 76


@FAST
@given(n=st.integers(20, 500), seed=st.integers(0, 2**32), other=st.integers(0, 2**32), epoch=st.integers(0, 50))
def test_seeds_give_different_permutations(n, seed, other, epoch):
    if seed == other:
        other += 1
    a = SampleStream(n, seed).permutation(epoch)
    assert sorted(a.tolist()) == list(range(n))
    assert not np.array_equal(a, SampleStream(n, other).permutation(epoch))
    assert not np.array_equal(a, SampleStream(n, seed).permutation(epoch + 1))  # each epoch reshuffles


@FAST
@given(n=st.integers(1, 50), seed=st.integers(0, 2**32), stream=st.integers(0, 8),
       reads=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 120)), min_size=1, max_size=8))
def test_same_seed_is_deterministic(n, seed, stream, reads):
    """Any order of reads (including ones that revisit evicted epochs) gives the same indices."""
    a, b = SampleStream(n, seed, stream), SampleStream(n, seed, stream)
    expected = [a.take(start, length) for start, length in reads]
    for (start, length), want in zip(reversed(reads), reversed(expected)):
        np.testing.assert_array_equal(b.take(start, length), want)
        np.testing.assert_array_equal(a.take(start, length), want)


@FAST
@given(n=st.integers(20, 300), seed=st.integers(0, 2**32), ranks=st.lists(st.integers(0, 64), min_size=2,
                                                                            max_size=6, unique=True))
def test_asp_streams_of_different_ranks_differ(n, seed, ranks):
    perms = [SampleStream(n, seed, stream=1 + r).take(0, n) for r in ranks]
    for p in perms:
        assert sorted(p.tolist()) == list(range(n))
    for i in range(len(perms)):
        for j in range(i + 1, len(perms)):
            assert not np.array_equal(perms[i], perms[j])
    assert all(not np.array_equal(p, SampleStream(n, seed, stream=0).take(0, n)) for p in perms)  # nor BSP's


@FAST
@given(n=st.integers(1, 40), seed=st.integers(0, 2**32), start=st.integers(0, 200), length=st.integers(0, 150))
def test_take_across_epoch_boundaries(n, seed, start, length):
    s = SampleStream(n, seed)
    got = s.take(start, length)
    ref = SampleStream(n, seed)
    want = [int(ref.permutation(p // n)[p % n]) for p in range(start, start + length)]
    assert got.tolist() == want
    assert got.dtype == np.int64 and len(got) == length
    # splitting a read anywhere does not change it
    cut = start + length // 3
    np.testing.assert_array_equal(np.concatenate([s.take(start, cut - start), s.take(cut, start + length - cut)]),
                                  got)


def test_take_nothing_and_tiny_datasets():
    assert SampleStream(5, 0).take(7, 0).tolist() == []
    assert SampleStream(1, 0).take(3, 4).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        SampleStream(0, 0)


def test_negative_seed_is_refused_by_the_job_spec():
    with pytest.raises(ValueError, match="--seed"):
        JobSpec(seed=-1).check()
