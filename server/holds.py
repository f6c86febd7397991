"""ASP and SSP bookkeeping: each worker's newest step applied, and SSP's replies held
until the slowest worker still in the job is within `staleness` steps. Pure: the shard
core applies each push on arrival and answers what this releases."""

import math

from omnips.protocol import Push


class Holds:
    def __init__(self, staleness: int):
        self.staleness = staleness
        self.last_step: dict[int, int] = {}  # newest step applied per rank
        self.held: list[tuple[bytes, Push, float]] = []  # SSP replies waiting for the slowest worker
        self.joiners: set[int] = set()  # ranks (re)activated that have not pushed yet: not waited for

    def refusal(self, peer: bytes, msg: Push) -> tuple[str, str] | None:
        if msg.step <= self.last_step.get(msg.rank, -1):
            return "duplicate", f"worker {msg.rank} already pushed step {msg.step}"
        if any((held, p.rank) == (peer, msg.rank) for held, p, _ in self.held):
            return "reply_held", (f"worker {msg.rank}'s last push is still unanswered (SSP holds the reply until "
                                  "the slowest worker is near): a worker pushes again only once answered")
        return None

    def refilled(self, rank: int) -> None:
        """A new worker took `rank`: its own step count, not waited for until it pushes."""
        self.last_step.pop(rank, None)
        self.joiners.add(rank)

    def hold(self, peer: bytes, msg: Push, now: float) -> None:
        self.held.append((peer, msg, now))

    def release(self, batches, now: float) -> list[tuple[bytes, Push, float]]:
        """The held replies within `staleness` steps of the slowest worker with a batch in
        `batches` (one that just joined counts from its first push)."""
        steps = [self.last_step.get(r, -1) for r, b in enumerate(batches) if b and r not in self.joiners]
        slowest = min(steps, default=math.inf)
        ready = [h for h in self.held if h[1].step - slowest <= self.staleness]
        self.held = [h for h in self.held if h[1].step - slowest > self.staleness]
        return ready

    def release_all(self) -> list[tuple[bytes, Push, float]]:
        """The job is ending: nobody waits for the slowest any more."""
        held, self.held = self.held, []
        return held

    def clear(self) -> None:
        self.held = []
        self.joiners.clear()
