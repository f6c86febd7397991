"""The job's progress: steps, samples, epochs, when to evaluate and when to stop.

Pure logic fed with worker reports. Evaluations read the servers' parameters
through pulls: in BSP at exact versions known in advance (the step that ends each
epoch, and the last step), so every shard is read at the same version; in ASP,
which has no common version, as soon as the sample count crosses an epoch.
A resumed job starts from a checkpoint's counts: its steps and samples count
toward the budget, while times and rates cover only the steps run since.
"""

import math
from dataclasses import dataclass

from omnips.job import MAX_EPOCHS, JobSpec
from omnips.protocol import Report


@dataclass
class WorkerStats:
    steps: int = 0
    samples: int = 0
    start: int = 0  # steps done before a resume, which this scheduler did not time
    compute_s: float = 0.0
    network_s: float = 0.0
    wait_s: float = 0.0
    loss: float | None = None
    done: bool = False
    present: bool = False  # a worker is in this rank now
    next_step: int | None = 0  # the step its next report is for; None: any (it just joined)
    rewound: bool = False  # sent back to a checkpoint: reports it sent before it knew may still come


@dataclass(frozen=True)
class EvalPoint:
    epoch: float
    at: int | None  # the server version to read, None for "now"


def whole_step_s(r: Report) -> float:
    """How long the reported step took: compute, overhead (the network among it) and the servers' hold."""
    return r.compute_s + r.overhead_s + r.wait_s


class Progress:
    def __init__(self, job: JobSpec, train_size: int):
        self.job = job
        self.train_size = train_size
        self.budget = job.sample_budget(train_size)
        if job.mode == "bsp" and self.budget > MAX_EPOCHS * train_size:
            # BSP lists an evaluation per epoch at the start (bsp_eval_points); JobSpec.check bounds
            # --epochs, not --max-steps x --global-batch. (ASP/SSP evaluate as epochs pass: a
            # job kept running by a huge --max-steps lists nothing.)
            raise ValueError(f"the job's {self.budget} samples are {self.budget / train_size:.3g} epochs of its "
                             f"{train_size} training samples, more than {MAX_EPOCHS}: "
                             "lower --max-steps or --global-batch")
        self.total_steps = job.total_steps(train_size)
        self.workers = [WorkerStats() for _ in range(job.num_workers)]
        self.samples = 0
        self.start_samples = 0
        self.first_start: float | None = None
        self.last_end: float | None = None
        self.last_report: float | None = None
        self.staleness_sum = 0
        self.staleness_max = 0
        self._epochs_seen = 0  # ASP: whole epochs for which an evaluation was asked

    def resume(self, worker_steps: list[int], positions: list[int]) -> None:
        """Continue from a checkpoint: each worker's next step and sample-stream position."""
        if self.job.mode == "bsp" and worker_steps[0] >= self.total_steps:  # none is taken at the last step
            raise ValueError(f"a checkpoint at step {worker_steps[0]} is past the job's {self.total_steps} steps")
        for w, steps, position in zip(self.workers, worker_steps, positions):
            w.steps = w.start = w.next_step = steps
            w.rewound = True
            w.samples = 0 if self.job.mode == "bsp" else position  # BSP: all read one stream, at positions[0]
        self.samples = self.start_samples = positions[0] if self.job.mode == "bsp" else sum(positions)
        self._epochs_seen = min(self.samples, self.budget) // self.train_size

    def restart_point(self, bsp_step: int | None = None) -> tuple[list[int], list[int]]:
        """(next step, sample-stream position) per worker for a checkpoint: in BSP at
        version `bsp_step` (every worker reads the global stream from bsp_step x B), in
        ASP/SSP as reported so far (each worker reads its own stream)."""
        if self.job.mode == "bsp":
            n = len(self.workers)
            return [bsp_step] * n, [bsp_step * self.job.global_batch] * n
        return [w.steps for w in self.workers], [w.samples for w in self.workers]

    def bsp_eval_points(self) -> list[EvalPoint]:
        """Versions that end each epoch, and the last one; ask for all at the start
        (resumed: those from the checkpoint's version on)."""
        b, n = self.job.global_batch, self.train_size
        versions = {math.ceil(k * n / b) for k in range(1, math.ceil(self.budget / n) + 1)}
        start = self.workers[0].start
        versions = sorted(v for v in versions if start <= v < self.total_steps) + [self.total_steps]
        return [EvalPoint(min(v * b, self.budget) / n, v) for v in versions]

    def seat(self, rank: int, joined: bool) -> None:
        """A worker took `rank`: at the start (of a resumed job, at its step), or `joined` a
        running job (its first step is not known yet)."""
        w = self.workers[rank]
        w.present, w.done, w.next_step = True, False, None if joined else w.steps  # w.steps: resumed

    def depart(self, rank: int) -> None:
        self.workers[rank].present = False

    def next_step(self, rank: int) -> int | None:
        return self.workers[rank].next_step

    def stale(self, r: Report) -> bool:
        """A report the worker sent before it read the rewind: the step it reports was undone."""
        return self.workers[r.rank].rewound and not self.expects(r)

    def expects(self, r: Report) -> bool:
        w = self.workers[r.rank]
        return w.present and not w.done and (w.next_step is None or r.step == w.next_step)

    def on_probe(self, seconds: float, now: float) -> None:
        """A worker's probe passes took `seconds` until `now`: the job's time counts from
        the earliest probe, since it delays the first step."""
        start = now - seconds
        self.first_start = start if self.first_start is None else min(self.first_start, start)

    def on_report(self, r: Report, now: float) -> list[EvalPoint]:
        """Account for a report; returns the ASP evaluations it makes due."""
        w = self.workers[r.rank]
        self.last_report = now
        w.rewound = False  # it reports from where it was sent back to: it has read the rewind
        if r.done:
            w.done = True
            return []
        w.next_step = r.step + 1
        if w.steps == w.start:  # its first step here: the job's time counts from the earliest one's start
            # (a BSP step's reports arrive together, in any order: the first read may be a slower worker's)
            start = now - whole_step_s(r)
            self.first_start = start if self.first_start is None else min(self.first_start, start)
        self.last_end = now
        w.steps += 1
        w.samples += r.batch
        w.compute_s += r.compute_s
        w.network_s += r.network_s
        w.wait_s += r.wait_s
        w.loss = r.loss
        self.samples += r.batch
        self.staleness_sum += r.staleness
        self.staleness_max = max(self.staleness_max, r.staleness)
        if self.job.mode == "bsp":
            return []
        epochs = min(self.samples, self.budget) // self.train_size
        due = [EvalPoint(float(k), None) for k in range(self._epochs_seen + 1, epochs + 1)
               if k * self.train_size < self.budget]  # the last one is the final evaluation
        self._epochs_seen = max(self._epochs_seen, epochs)
        return due[-1:]  # several crossed at once: one evaluation covers them

    @property
    def steps(self) -> int:
        """BSP: global steps; ASP/SSP: updates reported."""
        if self.job.mode == "bsp":
            return max(w.steps for w in self.workers)
        return sum(w.steps for w in self.workers)

    @property
    def reached(self) -> int:
        """The furthest step a present worker is at."""
        return max((w.next_step or 0 for w in self.workers if w.present), default=0)

    @property
    def epochs(self) -> float:
        return self.samples / self.train_size

    @property
    def budget_reached(self) -> bool:
        return self.samples >= self.budget

    @property
    def all_done(self) -> bool:
        present = [w for w in self.workers if w.present]
        return bool(present) and all(w.done for w in present)

    @property
    def wall_s(self) -> float:
        if self.first_start is None or self.last_end is None:
            return 0.0
        return self.last_end - self.first_start

    def summary(self) -> dict:
        wall = self.wall_s
        timed = [w.steps - w.start for w in self.workers]
        updates = sum(timed)
        return {
            "steps": self.steps,
            "epochs": self.epochs,
            "samples": self.samples,
            "wall_s": wall,
            "samples_per_s": (self.samples - self.start_samples) / wall if wall > 0 else 0.0,
            "worker_steps": [w.steps for w in self.workers],
            "worker_compute_s_per_step": [w.compute_s / t if t else 0.0 for w, t in zip(self.workers, timed)],
            "worker_wait_fraction": [(w.network_s + w.wait_s) / wall if wall > 0 else 0.0 for w in self.workers],
            "final_train_loss": [w.loss for w in self.workers],
            "staleness_mean": self.staleness_sum / updates if updates else 0.0,
            "staleness_max": self.staleness_max,
        }
