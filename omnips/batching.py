"""Batch plans: how the global batch is split among workers. Pure functions, no I/O."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchPlan:
    """Generation `gen` of the per-worker batch sizes; `stop` ends the job (ASP)."""

    gen: int
    batches: tuple[int, ...]
    stop: bool = False

    def to_wire(self) -> dict:
        return {"gen": self.gen, "batches": list(self.batches), "stop": self.stop}

    @classmethod
    def from_wire(cls, d, num_workers: int) -> "BatchPlan":
        """Validate a plan that came over the network; ValueError says what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"a batch plan is a map, not {type(d).__name__}")
        gen, batches, stop = d.get("gen"), d.get("batches"), d.get("stop", False)
        if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
            raise ValueError(f"plan generation {gen!r} is not a count")
        if (not isinstance(batches, list) or len(batches) != num_workers
                or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in batches)):
            raise ValueError(f"plan needs {num_workers} batch sizes >= 1, got {batches!r}")
        if not isinstance(stop, bool):
            raise ValueError(f"plan stop flag {stop!r} is not a bool")
        return cls(gen, tuple(batches), stop)


def largest_remainder(weights, total: int, minimum: int = 0) -> list[int]:
    """Integers proportional to `weights`, each >= `minimum`, that sum to `total` exactly.

    Shares that would fall below `minimum` are pinned there and the rest is split
    again among the others (water-filling); the real-valued shares are then rounded
    by largest remainder (ties to the lower index), so none is off by one or more.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero: {weights!r}")
    if minimum * len(w) > total:
        raise ValueError(f"{total} cannot give {len(w)} shares at least {minimum} each")
    pinned = np.zeros(len(w), dtype=bool)
    while True:
        free = ~pinned
        exact = np.full(len(w), float(minimum))
        if w[free].sum() > 0:
            exact[free] = w[free] / w[free].sum() * (total - minimum * pinned.sum())
        low = free & (exact < minimum)
        if not low.any():
            break
        pinned |= low
    out = np.floor(exact + 1e-9).astype(np.int64)
    order = np.argsort(-(exact - out), kind="stable")
    out[order[:total - int(out.sum())]] += 1
    return [int(x) for x in out]


def initial_batches(batching: str, global_batch: int, capacities) -> list[int]:
    """The starting split: equal (`uniform`) or in proportion to declared capacity."""
    weights = [1.0] * len(capacities) if batching == "uniform" else list(capacities)
    return largest_remainder(weights, global_batch, minimum=1)
