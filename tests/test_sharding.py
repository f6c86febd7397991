"""shard_ranges: contiguous, ordered, near-equal ranges over the flat parameter vector."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnips.sharding import shard_ranges

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(num_params=st.integers(0, 10**7), num_shards=st.integers(1, 300))
def test_ranges_cover_everything_in_order(num_params, num_shards):
    ranges = shard_ranges(num_params, num_shards)
    assert len(ranges) == num_shards
    assert ranges[0][0] == 0 and ranges[-1][1] == num_params
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi == lo  # no gap, no overlap
    lengths = [hi - lo for lo, hi in ranges]
    assert all(n >= 0 for n in lengths)
    assert sum(lengths) == num_params
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the extra elements go to the first shards
    assert all(isinstance(x, int) for r in ranges for x in r)


@FAST
@given(num_params=st.integers(0, 10**6), num_shards=st.integers(1, 64))
def test_every_index_belongs_to_exactly_one_shard(num_params, num_shards):
    ranges = shard_ranges(num_params, num_shards)
    probes = {i for i in (0, num_params - 1, num_params // 2, num_params // 3) if 0 <= i < num_params}
    for i in probes:
        owners = [s for s, (lo, hi) in enumerate(ranges) if lo <= i < hi]
        assert len(owners) == 1


@pytest.mark.parametrize("num_params, num_shards, expected", [
    (10, 3, [(0, 4), (4, 7), (7, 10)]),
    (9, 3, [(0, 3), (3, 6), (6, 9)]),
    (2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)]),
    (0, 2, [(0, 0), (0, 0)]),
    (7, 1, [(0, 7)]),
])
def test_known_splits(num_params, num_shards, expected):
    assert shard_ranges(num_params, num_shards) == expected


@FAST
@given(num_params=st.integers(0, 10**6), num_shards=st.integers(-10**6, 0))
def test_fewer_than_one_shard_is_refused(num_params, num_shards):
    with pytest.raises(ValueError, match="shard"):
        shard_ranges(num_params, num_shards)


@FAST
@given(num_params=st.integers(-10**6, -1), num_shards=st.integers(1, 100))
def test_negative_parameter_count_is_refused(num_params, num_shards):
    with pytest.raises(ValueError, match="parameter count"):
        shard_ranges(num_params, num_shards)
