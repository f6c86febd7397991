"""Who speaks for each worker rank at a shard: the connection bound to it, and the ranks
whose workers left (their later steps are waited for by nobody, until a new worker
re-fills the rank under a later plan). Pure."""

import math


class Members:
    def __init__(self):
        self.owner: dict[int, bytes] = {}  # rank -> the connection that speaks for it
        self.gone: dict[int, tuple[int, float]] = {}  # rank -> (its last step, the gen that re-filled it)

    def rank_of(self, peer: bytes) -> int | None:
        return next((r for r, p in self.owner.items() if p == peer), None)

    def refusal(self, peer: bytes, rank: int, gen: int, step: int) -> tuple[str, str] | None:
        """Why `peer` may not push `rank`'s `step` under plan `gen`; None: it may."""
        if self.excluded(rank, gen, step):
            return "removed", f"worker {rank} was removed from the job after step {self.gone[rank][0]}"
        if self.owner.get(rank, peer) != peer:
            return "rank_taken", f"worker rank {rank} is bound to another connection"
        return None

    def claim(self, peer: bytes, rank: int) -> tuple[str, str] | None:
        """Bind `rank` to `peer` unless another connection holds it."""
        if self.owner.setdefault(rank, peer) != peer:
            return "rank_taken", f"worker rank {rank} is bound to another connection"
        return None

    def excluded(self, rank: int, gen: int, step: int) -> bool:
        """The worker that held `rank` under plan `gen` is gone, and `step` is past its last."""
        last, refilled_at = self.gone.get(rank, (math.inf, 0))
        return step > last and gen < refilled_at

    def departed(self, rank: int, last: int) -> None:
        self.gone[rank] = (last, math.inf)

    def refilled(self, rank: int, gen: int) -> None:
        """A new worker holds `rank` from plan `gen` on, on a connection of its own."""
        if rank in self.gone:
            self.gone[rank] = (self.gone[rank][0], gen)
        self.owner.pop(rank, None)

    def clear(self) -> None:
        self.owner.clear()
        self.gone.clear()
