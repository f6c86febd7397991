"""Split the flat parameter vector into contiguous, near-equal shards (one per server)."""


def shard_ranges(num_params: int, num_shards: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges covering [0, num_params) in order; lengths differ by at most one.

    The first `num_params % num_shards` shards get the extra element, as ps-lite's
    key ranges do. A shard may be empty when there are more servers than parameters.
    """
    if num_shards < 1:
        raise ValueError(f"need at least one shard, not {num_shards}")
    if num_params < 0:
        raise ValueError(f"parameter count must be >= 0, not {num_params}")
    base, extra = divmod(num_params, num_shards)
    ranges, lo = [], 0
    for s in range(num_shards):
        hi = lo + base + (1 if s < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges
