"""Ctrl-C on `omnips launch`: the job stops through its scheduler, the run directory is
complete, and the launcher says in one line what was stopped and how to go on."""

import os
import signal
import subprocess
import sys

import pytest

from omnips.metrics import read_events

from helpers import WAIT_FACTOR, wait_for_steps


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.cluster
@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "none"])
def test_sigint_to_the_launcher_stops_the_job_and_leaves_a_complete_run_directory(tmp_path, checkpoints):
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "omnips.cli", "launch", "--run-dir", str(run_dir), "--num-servers", "1",
         "--num-workers", "2", "--emulate-ms-per-step", "20", "--max-steps", "100000", "--global-batch", "32",
         *(["--checkpoint-every", "10"] if checkpoints else []), "--heartbeat", "0.3", "--no-progress",
         "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_steps(run_dir, 2 * 25, timeout_s=120)
        launcher.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends (the children are not in its group)
        out, err = launcher.communicate(timeout=90 * WAIT_FACTOR)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    events = read_events(run_dir)
    summary = (run_dir / "summary.json").read_text()
    end = next(e for e in events if e["event"] == "end")
    stopped = end["stopped"]
    assert end["status"] == "interrupted" and stopped.startswith("SIGINT at step ") and "model.pt written" in stopped
    assert stopped in summary and (run_dir / "model.pt").exists()
    # the stop writes a checkpoint to resume from, with or without --checkpoint-every
    assert f"checkpoint {end['stopped'].split()[3].rstrip(':')} complete" in stopped, stopped
    # one line: what was stopped, where the run is, how to resume; nothing else but the status page's address
    said = [line for line in err.strip().splitlines() if not line.startswith("status page: ")]
    assert said == [f"omnips launch: interrupted: {stopped}; run directory {run_dir}; "
                    f"resume with: omnips launch --resume {run_dir}"], err
    assert out == ""
    # one stop, taken gracefully: no traceback in any log, and no process left behind
    for log in (run_dir / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
    pids = [e["pid"] for e in events if e["event"] == "membership"]
    assert len(pids) == 3 and not any(alive(pid) for pid in pids), pids
