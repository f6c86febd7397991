"""Driving a scheduler.core.SchedulerCore directly in tests: a core with one server
registered, registrations, a worker's report, and what its instructions send and record."""

from omnips.job import JobSpec
from omnips.protocol import Register, Report
from omnips.scheduler.core import SchedulerCore
from omnips.scheduler.instructions import Send, WriteEvent
from omnips.scheduler.options import SchedulerOptions

PARAMS = 100
TRAIN = 1000


def scheduler_core(tmp_path, token="", checkpoint_every=0, **job) -> SchedulerCore:
    spec = JobSpec(**{"batching": "dynamic", "num_servers": 1, **job})
    spec.check()
    opts = SchedulerOptions(run_dir=str(tmp_path / "run"), token=token, checkpoint_every=checkpoint_every)
    c = SchedulerCore(spec, opts, PARAMS, PARAMS, TRAIN, str(tmp_path / "run" / "checkpoints"))
    register(c, b"S", "server", token=token)
    return c


def register(c, peer, role, rank=-1, token="", now=0.0) -> list:
    return c.handle(peer, Register(role=role, host="h", endpoint="tcp://127.0.0.1:1" if role == "server" else "",
                                   rank=rank, token=token), now)


def step_report(rank: int, step: int, batch: int, done: bool = False, compute_s: float = 0.01) -> Report:
    """A worker's report of `step`, all its time compute."""
    return Report(rank=rank, step=step, batch=batch, compute_s=compute_s, network_s=0.0, wait_s=0.0, loss=1.0,
                  done=done)


def sent(out, to=None, kind=object) -> list:
    return [i.msg for i in out if isinstance(i, Send) and (to is None or i.to == to) and isinstance(i.msg, kind)]


def events(out, kind) -> list[dict]:
    return [i.fields for i in out if isinstance(i, WriteEvent) and i.kind == kind]
