"""A stop asked by a signal (SIGTERM: a preemption, a supervisor): the workers stop after
their step in flight, as at the end of the sample budget; once all have, the servers are
read for model.pt and, with --checkpoint-every, asked for a checkpoint to resume from,
at the version where the workers stopped. All within STOP_WAIT_S (a supervisor's SIGKILL
follows its SIGTERM), then the job ends as interrupted, saying what it saved."""

from dataclasses import dataclass

STOP_WAIT_S = 20.0


@dataclass
class Stop:
    why: str  # what asked for it, e.g. "SIGTERM"
    deadline: float
    saving: bool = False  # the model (and checkpoint) were asked of the servers
    checkpoint_req: int | None = None  # the checkpoint request waited for; None: none (asked)
    checkpoint: str = ""  # what became of it, once answered

    @property
    def saved(self) -> bool:
        """Every answer is in: the model, and the checkpoint if one was asked."""
        return self.checkpoint_req is None or bool(self.checkpoint)

    def on_checkpoint(self, req: int, step: int, failure: str | None) -> None:
        if req == self.checkpoint_req:
            self.checkpoint = f"checkpoint {step} complete" if failure is None else f"checkpoint {step} failed: {failure}"

    def status(self, steps: int, model: bool) -> str:
        """The job's end as summary.json says it."""
        what = [f"the workers stopped at {steps} steps", "model.pt written" if model else "model.pt not written"]
        if self.checkpoint_req is not None:
            what.append(self.checkpoint or "the checkpoint was not answered")
        return f"interrupted ({self.why}): " + ", ".join(what)
