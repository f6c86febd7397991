"""The job spec: everything about a training job that the scheduler owns and hands out.

Servers and workers receive it at registration, so nothing has to be kept
consistent by hand across command lines. `config.json` in the run directory is
`JobSpec.to_dict()`.
"""

import math
import typing
from dataclasses import asdict, dataclass, field, fields

from .fieldchecks import MAX_BATCH

MODES = ("bsp", "asp", "ssp")
OPTIMIZERS = ("sgd", "adam")
BATCHINGS = ("uniform", "static", "dynamic")
CONTROLLERS = ("affine", "proportional")
STALENESS_LR = ("none", "inverse")
ASYNC_CORRECTIONS = ("dana", "momentum", "lookahead", "dc", "gap", "none")  # server/asynchrony.py
NAN_POLICIES = ("fail", "skip")
WIRE_DTYPES = ("float32", "bfloat16", "float16")
# The job travels in msgpack messages, whose integers are at most int64.
MAX_INT = 2**63 - 1
# The largest cluster the benchmarks measure (benchmarks/simulate.py, 4096 workers). A rewind lists
# every worker's step and position and every server's endpoints in one header of at most
# omnips.protocol.MAX_HEADER_BYTES (1 MiB): with typical endpoints 4096 fit, 10**4 servers do not.
MAX_PROCESSES = 4096
# BSP evaluates at the end of every epoch and lists those versions at the start: 10**5 of
# them take 0.4 s and 16 MB there (and a metrics line each), 10**6 take seconds and 175 MB.
MAX_EPOCHS = 100_000
# Every process exits with this when the job was preempted (SIGTERM or SIGUSR1 to the scheduler,
# or SIGTERM to a server): it stopped at a step boundary after writing a checkpoint, and the same
# command with --resume auto goes on from there. EX_TEMPFAIL of sysexits.h: "try again later",
# which batch systems can be told to requeue on.
PREEMPTED_EXIT = 75


@dataclass(frozen=True)
class JobSpec:
    mode: str = "bsp"
    num_servers: int = 1
    num_workers: int = 2  # ranks; with min_workers, the most workers at once
    min_workers: int | None = None  # start with this many; None: all num_workers
    model: str = "mlp"
    model_args: dict = field(default_factory=dict)
    dataset: str = "digits"
    dataset_args: dict = field(default_factory=dict)
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    global_batch: int = 64
    epochs: float = 10.0
    max_steps: int | None = None
    batching: str = "uniform"
    controller: str = "affine"
    adjust_every: int = 10
    deadband: float = 0.05
    probe: bool = True  # dynamic batching: plan the first step from timed passes on every worker
    min_batch: int = 1
    max_batch: int | None = None
    staleness: int = 3  # ssp: how many steps a worker may run ahead of the slowest
    staleness_lr: str = "none"
    async_correction: str = "dana"  # asp/ssp: how updates allow for their staleness (server/asynchrony.py)
    nan_policy: str = "fail"  # a worker's non-finite gradient: end the job, or drop that gradient
    wire_dtype: str = "float32"  # pushes and their replies travel in it; servers keep float32 (omnips/wire.py)
    seed: int = 0

    def check(self) -> None:
        """Raise ValueError naming the first setting that cannot work."""
        for name, allowed in (("mode", MODES), ("optimizer", OPTIMIZERS), ("batching", BATCHINGS),
                              ("controller", CONTROLLERS), ("staleness_lr", STALENESS_LR),
                              ("async_correction", ASYNC_CORRECTIONS),
                              ("nan_policy", NAN_POLICIES), ("wire_dtype", WIRE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{_flag(name)} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if self.adjust_every < 2:
            raise ValueError(f"--adjust-every must be >= 2 (the first step after a change is not measured), "
                             f"not {self.adjust_every}")
        if not 0 <= self.deadband < 1:
            raise ValueError(f"--deadband must be in [0, 1), not {self.deadband}")
        if self.staleness < 0:
            raise ValueError(f"--staleness must be >= 0, not {self.staleness}")
        for f in fields(self):
            if type(getattr(self, f.name)) is int and getattr(self, f.name) > MAX_INT:
                raise ValueError(f"{_flag(f.name)} must be at most {MAX_INT}, not {getattr(self, f.name)}")
        for name in ("num_servers", "num_workers"):
            if not 1 <= getattr(self, name) <= MAX_PROCESSES:
                raise ValueError(f"{_flag(name)} must be from 1 to {MAX_PROCESSES}, not {getattr(self, name)}")
        if self.min_workers is not None and not 1 <= self.min_workers <= self.num_workers:
            raise ValueError(f"--min-workers must be in 1..--num-workers ({self.num_workers}), not {self.min_workers}")
        if self.global_batch < self.num_workers:
            raise ValueError(f"--global-batch {self.global_batch} is smaller than --num-workers "
                             f"{self.num_workers}: every worker needs at least one sample per step")
        if self.global_batch > MAX_BATCH:  # a lone worker may have to take all of it
            raise ValueError(f"--global-batch must be at most {MAX_BATCH}, not {self.global_batch}")
        for name in ("lr", "momentum", "weight_decay", "epochs", "deadband"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{_flag(name)} must be a finite number, not {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, not {self.seed}")
        if self.min_batch < 1:
            raise ValueError(f"--min-batch must be >= 1, not {self.min_batch}")
        if self.min_batch * self.num_workers > self.global_batch:
            raise ValueError(f"--min-batch {self.min_batch} x {self.num_workers} workers exceeds "
                             f"--global-batch {self.global_batch}")
        if self.max_batch is not None and (not self.min_batch <= self.max_batch <= MAX_BATCH
                                           or self.max_batch * self.start_workers < self.global_batch):
            raise ValueError(f"--max-batch {self.max_batch} must be from --min-batch to {MAX_BATCH} and let "
                             f"{self.start_workers} workers hold --global-batch {self.global_batch}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, not {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), not {self.momentum}")
        if self.nesterov and (self.optimizer != "sgd" or self.momentum == 0):
            raise ValueError("--nesterov needs --optimizer sgd with --momentum > 0")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, not {self.weight_decay}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, not {self.max_steps}")
        if self.max_steps is None and not 0 < self.epochs <= MAX_EPOCHS:
            raise ValueError(f"--epochs must be > 0 and at most {MAX_EPOCHS}, not {self.epochs}")

    @property
    def start_workers(self) -> int:
        return self.num_workers if self.min_workers is None else self.min_workers

    @property
    def batch_bounds(self) -> tuple[int, int]:
        """[min, max] per-worker batch the job allows (a lone survivor may need all of it)."""
        return self.min_batch, self.max_batch or self.global_batch

    def sample_budget(self, train_size: int) -> int:
        """Samples the job trains on: max_steps global batches, else `epochs` passes."""
        if self.max_steps is not None:
            return self.max_steps * self.global_batch
        return math.ceil(self.epochs * train_size)

    def total_steps(self, train_size: int) -> int:
        """BSP steps in the job (every BSP step consumes exactly global_batch samples)."""
        return math.ceil(self.sample_budget(train_size) / self.global_batch)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "JobSpec":
        """The job `d` (e.g. a run's config.json) describes; ValueError naming the first
        setting that is unknown, of the wrong type, or cannot work."""
        if not isinstance(d, dict):
            raise ValueError(f"job settings must be a JSON object, not {type(d).__name__}")
        kinds = {f.name: f.type for f in fields(cls)}
        unknown = set(d) - set(kinds)
        if unknown:
            raise ValueError(f"unknown job settings: {sorted(unknown)}")
        spec = cls(**{name: _typed(name, value, kinds[name]) for name, value in d.items()})
        spec.check()
        return spec


def same_job(saved, job: JobSpec) -> bool:
    """Whether `saved` (a job's settings as a file holds them) describes `job`; a setting
    added since the file was written counts at its default."""
    try:
        return JobSpec.from_dict(saved) == job
    except ValueError:
        return False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(name, value, kind):
    """`value` as job setting `name` of field type `kind` (e.g. `int | None`). Exact types:
    a bool is no int (True would be a batch of 1); an int stands for a float."""
    allowed = typing.get_args(kind) or (kind,)
    if float in allowed and type(value) is int:
        try:
            return float(value)
        except OverflowError:
            raise ValueError(f"job setting {name} is beyond a float's range") from None
    if type(value) not in allowed:
        wanted = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
        raise ValueError(f"job setting {name} must be {wanted}, not {type(value).__name__}")
    return value
