"""BSP's barrier: the pushes of step `version` collected until every worker of the plan
they were computed under, still in the job, has pushed; and the joiners' pulls that wait
for the first step of their plan. Pure bookkeeping: the shard core applies the step."""

from omnips.protocol import Pull, Push

MAX_WAITING_PULLS = 1024  # the scheduler keeps a few dozen evaluation pulls waiting


class Barrier:
    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        # gen -> batches: who a step waits for; every rank until the scheduler's first plan says otherwise
        self.plans: dict[int, tuple[int, ...]] = {0: (1,) * num_workers}
        self.pending: dict[int, tuple[bytes, Push, float, list]] = {}  # rank -> (peer, push, arrival, its values
        # as (offset, values) segments) for the step being collected
        self.gen: int | None = None  # the plan those pushes were computed under
        self.pulls: list[tuple[bytes, Pull, float]] = []  # joiners waiting for their first step

    def refusal(self, msg: Push, version: int) -> tuple[str, str] | None:
        """Why `msg` cannot join the step being collected, as (code, text); None: it can."""
        if msg.step != version:
            return "bad_step", f"push for step {msg.step}, shard is collecting step {version}"
        if msg.rank in self.pending:
            return "duplicate", f"worker {msg.rank} already pushed step {msg.step}"
        if self.plans and msg.gen < min(self.plans):
            # the steps under it are done: no step would run it, and a step waiting for it never ends
            return "bad_gen", (f"push under plan {msg.gen}, which no step runs any more: this shard keeps plans "
                               f"{sorted(self.plans)}")
        if self.pending and msg.gen != self.gen:
            return "bad_gen", f"push under plan {msg.gen}, step {msg.step} runs plan {self.gen}"
        if not self.plans.get(msg.gen, (1,) * self.num_workers)[msg.rank]:
            return "not_in_plan", f"worker {msg.rank} has no batch in plan {msg.gen}"
        return None

    def add(self, peer: bytes, msg: Push, now: float, segments: list) -> None:
        self.pending[msg.rank] = (peer, msg, now, segments)
        self.gen = msg.gen

    def waiting(self, version: int, excluded) -> list[int] | None:
        """The ranks step `version` still waits for (excluded(rank, gen, step): that worker
        is gone); None while nothing is pending or its plan has not arrived."""
        batches = self.plans.get(self.gen)
        if not self.pending or batches is None:
            return None
        return [r for r, b in enumerate(batches) if b and r not in self.pending and not excluded(r, self.gen, version)]

    def take(self) -> list[tuple[bytes, Push, float, list]]:
        """The step's pushes, in rank order (the sum is taken in it, for repeatable runs);
        the plans before theirs are done."""
        pushes = [self.pending[r] for r in sorted(self.pending)]
        self.pending.clear()
        self.plans = {g: b for g, b in self.plans.items() if g >= self.gen}
        self.gen = None
        return pushes

    def departed(self, rank: int, last: int, version: int) -> None:
        """`rank` left after its step `last`: a push of a later step is used by no shard."""
        if rank in self.pending and version > last:
            del self.pending[rank]  # it died before every shard had its push

    def gen_ready(self, gen: int) -> bool:
        """Whether a joiner of plan `gen` can start: the step being collected runs it or a later one."""
        return self.gen is not None and self.gen >= gen and self.gen in self.plans

    def wait_pull(self, peer: bytes, msg: Pull, now: float) -> bool:
        """Hold a joiner's pull until gen_ready; False when MAX_WAITING_PULLS already wait."""
        if len(self.pulls) >= MAX_WAITING_PULLS:
            return False
        self.pulls.append((peer, msg, now))
        return True

    def due_pulls(self) -> list[tuple[bytes, Pull, float]]:
        due = [e for e in self.pulls if self.gen_ready(e[1].gen)]
        self.pulls = [e for e in self.pulls if not self.gen_ready(e[1].gen)]
        return due

    def clear(self) -> None:
        """Forget every push, pull and plan (the job goes back to a checkpoint)."""
        self.pending.clear()
        self.gen = None
        self.pulls = []
        self.plans = {}
