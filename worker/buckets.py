"""Which slices of the flat gradient go to the servers as one message, and when each
is complete. Pure logic: the worker's backward hooks call `ready(i)` as parameter i's
gradient is final, and send the buckets it completes while backward goes on.

Buckets are cut at parameter boundaries once they hold `bucket_values` values, at
every shard boundary (a push goes to one server) and where the trained parameters
end: the buffers' slots are filled after backward, so they go last. Backward
produces the last layers' gradients first, so the buckets at the end of the flat
vector leave first.
"""

from dataclasses import dataclass

from omnips.protocol import MAX_PARTS


@dataclass(frozen=True)
class Bucket:
    shard: int
    lo: int  # [lo, hi) of the flat vector, inside one shard
    hi: int


class BucketPlan:
    def __init__(self, spans: list[tuple[int, int]], size: int, ranges: list[tuple[int, int]], bucket_values: int):
        """`spans`: each trained parameter's [lo, hi) in the flat vector, in order; `size`:
        the flat vector's length (buffers' slots after the last span); `ranges`: the shards;
        `bucket_values` 0: one bucket per shard, sent after backward; else at least
        bucket_floor(ranges) (self.bucket_values: what the plan uses)."""
        trained = spans[-1][1] if spans else 0
        cuts = {0, size, *(lo for lo, _ in ranges)}
        bucket_values = floored(bucket_values, ranges)
        self.bucket_values = bucket_values
        if bucket_values > 0:
            cuts.add(trained)
            filled = 0
            for lo, hi in spans:
                filled += hi - lo
                if filled >= bucket_values:
                    cuts.add(hi)
                    filled = 0
        cuts = sorted(c for c in cuts if 0 <= c <= size)
        shard_of = _shard_index(ranges)
        self.buckets = [Bucket(shard_of(lo), lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
        # parameter i -> the buckets holding part of it; bucket -> how many parameters it waits for
        self.touches = [[b for b, bk in enumerate(self.buckets) if bk.lo < hi and lo < bk.hi] for lo, hi in spans]
        self._needs = [0] * len(self.buckets)
        for touched in self.touches:
            for b in touched:
                self._needs[b] += 1
        self._left = list(self._needs)
        self.sent = [False] * len(self.buckets)

    def start(self) -> None:
        """A new step: nothing sent, every bucket waits for all its parameters."""
        self.sent = [False] * len(self.buckets)
        self.again()

    def again(self) -> None:
        """The step's gradients are computed again (after an out-of-memory pass): count
        anew, but what was sent stays sent (its gradients were final)."""
        self._left = list(self._needs)

    def ready(self, param: int) -> list[int]:
        """Parameter `param`'s gradient is final: the unsent buckets that are now complete."""
        done = []
        for b in self.touches[param]:
            self._left[b] -= 1
            if self._left[b] == 0 and not self.sent[b]:
                done.append(b)
        return done

    def unsent(self) -> list[int]:
        return [b for b, s in enumerate(self.sent) if not s]

    def completes_shard(self, b: int) -> bool:
        """Whether bucket b is the last one of its shard not sent yet."""
        shard = self.buckets[b].shard
        return all(self.sent[o] for o, bk in enumerate(self.buckets) if bk.shard == shard and o != b)


def bucket_values(bucket_bytes: int) -> int:
    """The float32 values in a bucket of `bucket_bytes`, rounded up: only 0 turns buckets off
    (a size of 1-3 bytes is one value, which the plan raises to bucket_floor)."""
    return -(-bucket_bytes // 4)


def bucket_floor(ranges: list[tuple[int, int]]) -> int:
    """The fewest values a bucket may be cut at, so that no shard's push is in more than
    MAX_PARTS parts (a server refuses more). Cuts by size lie at least that far apart, so
    at most 1 + L // floor of them fall inside a shard of L values; with its start and the
    end of the trained parameters, each starting a part, that is at most MAX_PARTS - 1 parts."""
    return -(-max(hi - lo for lo, hi in ranges) // (MAX_PARTS - 4))


def floored(bucket_values: int, ranges: list[tuple[int, int]]) -> int:
    """The bucket size a plan cuts at when asked for `bucket_values` (0: none, after backward)."""
    return max(bucket_values, bucket_floor(ranges)) if bucket_values > 0 else 0


def _shard_index(ranges: list[tuple[int, int]]):
    def shard_of(pos: int) -> int:
        for s, (lo, hi) in enumerate(ranges):
            if lo <= pos < hi:
                return s
        raise ValueError(f"position {pos} lies in no shard")
    return shard_of
