"""`omnips slurm`'s sbatch script, submitted to a real Slurm (tests/slurm_cluster.py): a
heterogeneous job of the scheduler and a server on one node and two CPU workers on another."""

import json
import re
import subprocess
import sys
import time

import pytest
from slurm_cluster import SlurmCluster

from omnips import slurm

from helpers import WAIT_FACTOR

pytestmark = pytest.mark.cluster  # every test here starts processes

TINY_JOB = ["--num-servers", "1", "--num-workers", "2", "--model", "mlp", "--dataset", "digits", "--epochs", "1",
            "--global-batch", "32"]
JOB_TIMEOUT_S = 300


def generate(*argv) -> str:
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "slurm", *argv], capture_output=True, text=True,
                         timeout=60 * WAIT_FACTOR)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_script_asks_for_one_component_per_kind_of_node(tmp_path):
    script = generate(*TINY_JOB, "--num-workers", "3", "--device", "cuda", "cpu", "cpu", "--threads", "2",
                      "--partition", "cpu", "--gpu-partition", "gpu", "--gpus-per-worker", "2", "--time", "30",
                      "--run-dir", str(tmp_path / "run"))
    directives = [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives[-5:] == ["--partition=cpu --ntasks=2", "hetjob", "--partition=gpu --ntasks=1 --gpus-per-task=2",
                               "hetjob", "--partition=cpu --ntasks=2 --cpus-per-task=2"]
    assert "--time=30" in directives and f"--signal=B:USR1@{slurm.WARNING_S}" in directives
    assert "--requeue" in directives
    workers = [line for line in script.splitlines() if line.startswith("srun") and "-m omnips.worker" in line]
    assert [re.search(r"--het-group=(\d)", w).group(1) for w in workers] == ["1", "2", "2"]
    assert all("--kill-on-bad-exit=0" in w and f"{sys.executable} -m omnips.worker" in w for w in workers)
    assert "--gpus-per-task=2" in workers[0] and "--gpus-per-task" not in workers[1]
    assert f"PREEMPTED_EXIT={slurm.PREEMPTED_EXIT}" in script


def test_refused_flags_say_why(tmp_path):
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "slurm", "--mode", "nope"], capture_output=True,
                         text=True, timeout=60 * WAIT_FACTOR)
    assert out.returncode == 2 and "--mode" in out.stderr.splitlines()[-1]
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "slurm", "--port", "5555"], capture_output=True,
                         text=True, timeout=60 * WAIT_FACTOR)
    assert out.returncode == 2 and "--port: set by the generated job" in out.stderr
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "slurm", "--timeout", "60"], capture_output=True,
                         text=True, timeout=60 * WAIT_FACTOR)
    assert out.returncode == 2 and "--timeout: for omnips launch only" in out.stderr


def test_a_tiny_job_runs_on_slurm(slurm_cluster, tmp_path):
    """The docs' Slurm commands (docs/clusters.md, 'Slurm'), on a real Slurm: omnips slurm, then sbatch."""
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(generate(*TINY_JOB, "--run-dir", str(run_dir), "--time", "10"))
    started = time.monotonic()
    job_id = slurm_cluster.cmd("sbatch", "--parsable", str(script), cwd=tmp_path).stdout.strip().split(";")[0]
    state = slurm_cluster.wait_job(job_id, JOB_TIMEOUT_S)
    wall_s = time.monotonic() - started
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(run_dir.rglob("*.log")))
    assert state["JobState"] == "COMPLETED", (state, logs, slurm_cluster.log_tail())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["num_workers"] == 2 and summary["epochs"] >= 1
    assert len(summary["worker_steps"]) == 2 and min(summary["worker_steps"]) > 0
    # every role found the scheduler at component 0's node address, through the run directory
    address = (run_dir / "scheduler.address").read_text().strip()
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", address)
    nodes = {c["NodeList"] for c in _components(slurm_cluster, job_id)}
    assert len(nodes) == 2, nodes  # the scheduler and server apart from the workers
    out = (tmp_path / f"omnips-{job_id}.out").read_text()
    assert f"scheduler at {address}" in out and "the scheduler exited with 0" in out
    print(f"Slurm job {job_id}: {wall_s:.1f} s from sbatch to COMPLETED")


def _components(cluster: SlurmCluster, job_id: str) -> list[dict]:
    lines = cluster.cmd("scontrol", "show", "job", "-o", job_id).stdout.splitlines()
    return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in lines]


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpointed", "no-checkpoint"])
def test_a_preempted_job_is_requeued_and_resumes(slurm_cluster, tmp_path, checkpoints):
    """Slurm's time-limit warning (USR1 to the batch shell) stops the job with a checkpoint (one
    the preemption writes itself without --checkpoint-every); the script requeues it and its
    second run resumes from that checkpoint to the end."""
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sh"
    every = ["--checkpoint-every", "5"] if checkpoints else []
    script.write_text(generate(*TINY_JOB, "--epochs", "2", *every, "--emulate-ms-per-step", "100",
                               "--run-dir", str(run_dir)))
    job_id = slurm_cluster.cmd("sbatch", "--parsable", str(script), cwd=tmp_path).stdout.strip().split(";")[0]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not _steps_at_least(metrics, 8):  # past the first complete checkpoint
        assert time.monotonic() < deadline, slurm_cluster.log_tail()
        time.sleep(0.5)  # the job's own pace: a step every 100 ms or more
    slurm_cluster.cmd("scancel", "--batch", "--signal=USR1", job_id)
    state = slurm_cluster.wait_job(job_id, JOB_TIMEOUT_S, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    out = (tmp_path / f"omnips-{job_id}.out").read_text()
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(run_dir.rglob("*.log")))
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, out, logs)
    second = "attempt 1, resumed"
    assert out.index(f"the scheduler exited with {slurm.PREEMPTED_EXIT}") < out.index("requeueing") \
        < out.index(second) < out.index("the scheduler exited with 0"), out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["resumed_from_step"] >= 8, summary  # where the warning stopped it
    said = {m.group(2): m.group(1) for m in re.finditer(r"omnips (\S+): (requeueing|scheduler at|the scheduler)",
                                                        out.replace("preempted; requeueing", "requeueing"))}
    print(f"Slurm job {job_id}: requeued at {said['requeueing']}, started again at {said['scheduler at']}, "
          f"resumed from step {summary['resumed_from_step']}")


def _steps_at_least(metrics, n: int) -> bool:
    if not metrics.exists():
        return False
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()
             if line.endswith("}") and '"event": "step"' in line]
    return bool(steps) and max(steps) >= n
