"""Evaluations in flight: shard replies gathered per request until the model is whole."""

from dataclasses import dataclass, field

from omnips.protocol import Params

from .progress import EvalPoint


@dataclass
class PendingEval:
    point: EvalPoint
    final: bool
    shards: dict[int, Params] = field(default_factory=dict)  # server rank -> reply (keeps its frame alive)


class EvalBook:
    def __init__(self, num_servers: int):
        self.num_servers = num_servers
        self.pending: dict[int, PendingEval] = {}
        self._next_req = 0
        self.final_asked = False

    def open(self, point: EvalPoint, final: bool) -> int:
        self._next_req += 1
        self.final_asked |= final
        self.pending[self._next_req] = PendingEval(point, final)
        return self._next_req

    def add(self, server: int, msg: Params) -> PendingEval | None:
        """Record one shard; returns the evaluation once every shard is in."""
        entry = self.pending.get(msg.req)
        if entry is None:
            return None
        entry.shards[server] = msg
        if len(entry.shards) < self.num_servers:
            return None
        return self.pending.pop(msg.req)
