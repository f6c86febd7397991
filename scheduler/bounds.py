"""Each worker's largest batch: the job's (--max-batch), lowered for good by the worker's own
--max-batch or an out-of-memory step, and the estimate its free memory gives, which follows
the memory up or down. A bound that would leave the workers in the plan unable to hold the
global batch together is refused.

Pure: no clock, no I/O.
"""

import numpy as np

from omnips.batching import equal_time, integerize, spread


class BatchBounds:
    def __init__(self, n: int, job_max: int, min_batch: int, global_batch: int):
        self.min_batch, self.global_batch = min_batch, global_batch
        self.hard = [job_max] * n  # the job's bound, --max-batch on the worker, an out-of-memory step: only falls
        self.memory: list[int | None] = [None] * n  # from the worker's free memory: follows it
        self.array = np.full(n, job_max, dtype=np.int64)  # the lower of the two, kept current
        self._uniform: tuple[tuple[bytes, bytes], np.ndarray | None] | None = None  # (ranks and bounds, real split)

    def limit(self, rank: int, max_batch: int, active: np.ndarray) -> None:
        """The worker can hold at most `max_batch` samples in one pass. ValueError when the
        `active` workers together could no longer hold the global batch."""
        bound = max(self.min_batch, min(self.hard[rank], max_batch))
        if not self._holds(rank, min(bound, int(self.array[rank])), active):
            raise ValueError(f"worker {rank} can hold only {max_batch} samples: the workers together cannot "
                             f"hold the global batch {self.global_batch}")
        self.hard[rank] = bound
        self._set(rank)

    def estimate(self, rank: int, max_batch: int, active: np.ndarray) -> bool:
        """The worker's free memory holds about `max_batch` samples: its bound, unless the
        `active` workers could then not hold the global batch (False: not applied)."""
        bound = max(self.min_batch, max_batch)
        if not self._holds(rank, min(bound, self.hard[rank]), active):
            return False
        self.memory[rank] = bound
        self._set(rank)
        return True

    def uniform(self, ranks: np.ndarray, lines: np.ndarray) -> tuple[int, ...] | None:
        """Equal batches for `ranks` within their bounds, as a plan of every rank (0 for the others),
        the samples an equal split leaves over going to the workers one more sample slows least by
        their `lines` (omnips/batching.integerize); None where the bounds allow no split. The
        real-valued split is kept while the ranks and bounds stay (at thousands of workers it
        costs a tenth of a decision)."""
        key = (ranks.tobytes(), self.array[ranks].tobytes())
        if self._uniform is None or self._uniform[0] != key:
            try:
                real = equal_time(np.tile([0.0, 1.0], (len(ranks), 1)), self.global_batch, self.min_batch,
                                  self.array[ranks])
            except ValueError:
                real = None
            self._uniform = (key, real)
        real = self._uniform[1]
        if real is None:
            return None
        return spread(integerize(real, self.global_batch, self.min_batch, self.array[ranks], lines), ranks,
                      len(self.array))

    def _set(self, rank: int) -> None:
        h, m = self.hard[rank], self.memory[rank]
        self.array[rank] = h if m is None else min(h, m)

    def _holds(self, rank: int, bound: int, active: np.ndarray) -> bool:
        others = active[active != rank]
        return bound + int(self.array[others].sum()) >= self.global_batch
