"""A shard's state as saved (what its next updates depend on), the instruction to write
it, and the checks a saved state passes before a shard takes it back. Pure."""

from dataclasses import dataclass

import numpy as np

from omnips.job import JobSpec, same_job


@dataclass(frozen=True)
class ShardState:
    """What a shard's next updates depend on, as copies. Pushes waiting at a barrier are
    not part of it: after a restore their workers push them again."""

    meta: dict  # JSON-able: the job, sizes, version, counters, last step per rank, optimizer scalars,
    # the asynchronous correction's staleness record
    arrays: dict[str, np.ndarray]  # "values", the optimizer's buffers as "opt.<name>", the asynchronous
    # correction's as "async.<name>"


@dataclass(frozen=True)
class Snapshot:
    """An instruction to the server: write `state` as checkpoint `step`, then answer `to`."""

    to: bytes
    request: int
    step: int
    state: ShardState


def check_saved(state: ShardState, job: JobSpec, n: int, trained: int,
                next_steps: list[int] | None) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(meta, the optimizer's buffers by name, the correction's arrays by name) of `state`, checked to fit a shard of `job`
    holding `n` values (`trained` of them parameters); `next_steps` as for
    ShardCore.restore. ValueError, naming what does not fit, otherwise. The optimizer's
    and the correction's records are checked by their owners."""
    m, arrays, workers = state.meta, state.arrays, job.num_workers
    if not same_job(m.get("job"), job):
        raise ValueError("the saved shard belongs to another job (its settings differ)")
    if (m.get("size"), m.get("trained")) != (n, trained):
        raise ValueError(f"the saved shard holds {m.get('size')} values ({m.get('trained')} trained), "
                         f"this one {n} ({trained})")
    values = arrays.get("values")
    if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != (n,):
        raise ValueError(f"the saved values are not {n} float32 numbers")
    last, stale = m.get("last_step"), m.get("staleness")
    if not (_ints(m.get("version"), m.get("updates"), lowest=0) and isinstance(stale, list) and len(stale) == 2
            and _ints(*stale, lowest=0) and isinstance(last, list) and len(last) == workers
            and _ints(*last, lowest=-1) and isinstance(m.get("optimizer"), dict)):
        raise ValueError("the saved shard's counters are malformed")
    if next_steps is not None and not (len(next_steps) == workers and _ints(*next_steps, lowest=0)):
        raise ValueError(f"next steps {next_steps} are not one step count per worker")
    if any(not k.startswith(("opt.", "async.")) for k in arrays if k != "values"):
        raise ValueError(f"the saved shard holds unknown arrays: {sorted(arrays)}")
    return (m, {k.removeprefix("opt."): v for k, v in arrays.items() if k.startswith("opt.")},
            {k.removeprefix("async."): v for k, v in arrays.items() if k.startswith("async.")})


def _ints(*values, lowest: int) -> bool:
    return all(type(v) is int and v >= lowest for v in values)
