"""A worker that cannot train says why before it exits, and one busy starting is not taken for dead.

Real processes: one worker's model factory (a user module written for the test) differs
from everyone else's, fails, stops itself, or takes seconds to build."""

import json
import os
import re
import signal

import pytest

from omnips.launch import WorkerSpec

from helpers import error_lines, finish, start_cluster, wait_for_event

pytestmark = pytest.mark.cluster  # every test here starts processes

# the odd worker is the one whose command line asks for rank `odd_rank`; the scheduler and
# the others build the same model
USER_CODE = '''
import os, signal, sys, time

from torch import nn


def _worker_rank():
    return int(sys.argv[sys.argv.index("--rank") + 1]) if "--rank" in sys.argv else None


def net(odd_rank=-1, odd="", build_s=0.0):
    me = _worker_rank()
    if me is not None:
        time.sleep(build_s)  # a slow build on a loaded host: the delay is the point
    if me == odd_rank and odd == "import":
        raise ImportError("No module named 'missing_dependency'")
    if me == odd_rank and odd == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen while it builds the model
    act = nn.Tanh() if me == odd_rank and odd == "tanh" else nn.ReLU()
    width = 40 if me == odd_rank and odd == "wider" else 32
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), act, nn.Linear(width, 10))
'''


@pytest.fixture
def user_env(tmp_path):
    (tmp_path / "oddjob").mkdir()
    (tmp_path / "oddjob" / "__init__.py").write_text("")
    (tmp_path / "oddjob" / "nets.py").write_text(USER_CODE)
    return {"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}


def job(steps: int, **model_args) -> list[str]:
    return ["--mode", "bsp", "--model", "oddjob.nets:net", "--model-args", json.dumps(model_args),
            "--max-steps", str(steps), "--global-batch", "24"]


@pytest.mark.parametrize("odd, said", [
    ("tanh", r"this worker's model differs from the scheduler's \(digest [0-9a-f]{16}, the scheduler's [0-9a-f]{16}\)"),
    ("wider", r"this worker's model has 3010 values, the scheduler's 2410: the model or its code differs"),
    ("import", r"model 'oddjob.nets:net' failed with .*ImportError: No module named 'missing_dependency'"),
])
def test_a_worker_that_cannot_train_says_why_and_the_others_go_on_at_once(tmp_path, user_env, odd, said):
    # --dead-after is the default 30 s: the job does not wait out the odd worker's silence, it is told
    run_dir = tmp_path / "run"
    with start_cluster(run_dir, job(30, odd_rank=1, odd=odd), [WorkerSpec(ms_per_step=10.0)] * 3,
                       env=user_env) as cluster:
        run = finish(cluster, expect_ok=False)
    codes = cluster.exit_codes()
    assert run.code == 0 and codes["worker1"] == 1, (codes, run.logs())
    assert all(c == 0 for n, c in codes.items() if n != "worker1"), codes
    [lost] = [e for e in run.events if e["event"] == "membership" and e["change"] == "lost"]
    assert lost["rank"] == 1 and re.fullmatch(rf"failed: worker 1 on \S+: .*{said}.*", lost["reason"]), lost
    # its last word is the reason, and the first step went on without it
    steps = [e for e in run.events if e["event"] == "step"]
    assert {e["worker"] for e in steps} == {0, 2} and run.events.index(lost) < run.events.index(steps[0])
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 1 and s["steps"] == 30, s
    log = (run_dir / "logs" / "worker1.log").read_text()
    assert len(error_lines(log)) == 1 and "Traceback" not in log and re.search(said, log), log[-2000:]
    assert re.search(rf"worker 1 lost \(failed: worker 1 on \S+: .*{said}", (run_dir / "logs" / "scheduler.log")
                     .read_text())


def test_workers_slow_to_build_their_model_are_not_taken_for_dead(tmp_path, user_env):
    # each worker builds its model for 3 s, longer than --dead-after: its heartbeats go on meanwhile
    run_dir = tmp_path / "run"
    flags = [*job(20, build_s=3.0), "--heartbeat", "0.25", "--dead-after", "2"]
    with start_cluster(run_dir, flags, [WorkerSpec(ms_per_step=10.0)] * 3, env=user_env) as cluster:
        run = finish(cluster)
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 0 and s["worker_steps"] == [20] * 3, s


def test_workers_whose_steps_compute_longer_than_dead_after_are_not_taken_for_dead(tmp_path, user_env):
    # each step's compute lasts 2.5 s on an emulated slow device, longer than --dead-after:
    # the heartbeats go on meanwhile, from the thread that owns the link to the scheduler
    run_dir = tmp_path / "run"
    flags = [*job(3), "--heartbeat", "0.25", "--dead-after", "2"]
    with start_cluster(run_dir, flags, [WorkerSpec(ms_per_step=2500.0)] * 2, env=user_env) as cluster:
        run = finish(cluster)
    s = run.summary
    assert s["status"] == "completed" and s["workers_lost"] == 0 and s["worker_steps"] == [3] * 2, s
    assert min(s["worker_compute_s_per_step"]) > 2.0, s  # (the steps did outlast --dead-after)


def test_a_worker_frozen_while_it_builds_its_model_is_lost_with_that_phase(tmp_path, user_env):
    run_dir = tmp_path / "run"
    flags = [*job(20, odd_rank=2, odd="stop"), "--heartbeat", "0.25", "--dead-after", "2"]
    with start_cluster(run_dir, flags, [WorkerSpec(ms_per_step=10.0)] * 3, env=user_env) as cluster:
        lost = wait_for_event(run_dir, lambda e: e["event"] == "membership" and e["change"] == "lost")
        cluster.procs["worker2"].send_signal(signal.SIGCONT)  # woken, it is told it was removed
        run = finish(cluster, expect_ok=False)
    assert lost["rank"] == 2 and re.fullmatch(r"silent for \d s, last heard building the model", lost["reason"]), lost
    assert run.code == 0 and run.summary["worker_steps"] == [20, 20, 0], run.logs()
