"""A full disk under the run directory: reported in a line, and the job goes on."""

import errno
import subprocess
from contextlib import contextmanager

import pytest
import torch

from omnips.launch import WorkerSpec

from helpers import WAIT_FACTOR, finish, in_log, start_cluster, wait_for_event

pytestmark = pytest.mark.cluster  # every test here starts processes


@contextmanager
def small_disk(tmp_path, size: str):
    """A run directory on a tmpfs of `size` (its logs/ on the ordinary disk: a process's
    report that the disk is full must be readable), unmounted on the way out."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    run_dir.mkdir()
    logs.mkdir()
    mounted = []

    def mount(*args):
        done = subprocess.run(["mount", *map(str, args)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"NOT TESTED: a full disk needs a small file system, and mount was refused: {done.stderr}")
        mounted.append(args[-1])

    try:
        mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", run_dir)
        (run_dir / "logs").mkdir()
        mount("--bind", logs, run_dir / "logs")
        yield run_dir
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", str(target)], check=True)


def fill(directory):
    """A file that takes every free byte of `directory`'s file system."""
    path = directory / "filler"
    chunk = b"\0" * (1 << 16)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return path


def test_a_full_disk_is_reported_in_a_line_and_the_job_goes_on_with_every_event(tmp_path):
    steps, every = 600, 20
    job = ["--mode", "bsp", "--max-steps", str(steps), "--global-batch", "32", "--seed", "2",
           "--checkpoint-every", str(every), "--heartbeat", "0.3"]
    with small_disk(tmp_path, "8m") as run_dir:
        with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 2) as cluster:
            wait_for_event(run_dir, lambda e: e["event"] == "checkpoint" and e["complete"])
            filler = fill(run_dir)
            logs = run_dir / "logs"
            in_log(logs / "scheduler.log", "cannot write")  # its events wait in memory
            in_log(logs / "server0.log", "not written")  # a checkpoint's file
            in_log(logs / "scheduler.log", "is incomplete")  # ... reported, and the scheduler lives on
            filler.unlink()
            run = finish(cluster)
        s = run.summary
        assert s["status"] == "completed" and s["steps"] == steps and s["events_lost"] == 0
        # every event that waited reached metrics.jsonl, whole (read_events refuses a damaged line)
        got = sorted((e["worker"], e["step"]) for e in run.events if e["event"] == "step")
        assert got == [(w, t) for w in (0, 1) for t in range(steps)]
        checkpoints = [e for e in run.events if e["event"] == "checkpoint"]
        failed = [e for e in checkpoints if not e["complete"]]
        assert failed and all("No space left on device" in e["error"] for e in failed)
        assert checkpoints[-1]["complete"]  # taken again once there is room
        assert not list(run_dir.rglob("*.tmp"))  # a failed write leaves the disk no fuller
        log = (logs / "scheduler.log").read_text()
        said = [line for line in log.splitlines() if "metrics.jsonl" in line]
        assert len(said) == 2 and "No space left on device" in said[0] and "written again" in said[1], said
        for name in ("scheduler", "server0", "worker0", "worker1"):
            assert "Traceback" not in (logs / f"{name}.log").read_text(), name
        assert torch.load(run_dir / "model.pt").keys()


def test_a_disk_full_to_the_end_ends_the_job_cleanly_with_the_reason(tmp_path):
    job = ["--mode", "bsp", "--max-steps", "150", "--global-batch", "32", "--seed", "2", "--checkpoint-every", "20",
           "--heartbeat", "0.3"]
    with small_disk(tmp_path, "8m") as run_dir:
        with start_cluster(run_dir, job, [WorkerSpec(ms_per_step=20.0)] * 2) as cluster:
            wait_for_event(run_dir, lambda e: e["event"] == "checkpoint" and e["complete"])
            fill(run_dir)
            codes = {name: proc.wait(timeout=120 * WAIT_FACTOR) for name, proc in cluster.procs.items()}  # each by itself
        logs = run_dir / "logs"
        log = (logs / "scheduler.log").read_text()
        assert codes["scheduler"] == 1 and all(code in (0, 1) for code in codes.values()), (codes, log[-3000:])
        errors = [line.split(" ERROR ", 1)[1] for line in log.splitlines() if " ERROR " in line]
        assert any(e.startswith(f"job failed: cannot write {run_dir / 'model.pt'}: [Errno 28]") for e in errors), errors
        assert any(e.startswith("cannot write the summary of the job") for e in errors), errors
        assert not (run_dir / "summary.json").exists() and not (run_dir / "model.pt").exists()
        assert not list(run_dir.rglob("*.tmp"))
        assert (run_dir / "metrics.jsonl").read_bytes().endswith(b"\n")  # whole lines only, none torn
        for name in codes:
            assert "Traceback" not in (logs / f"{name}.log").read_text(), name
