"""The commands as a user meets them, as real processes: the subcommand list, unknown
commands and flags named as such (no prefix taken for a flag), flag errors before torch
is imported, no run directory left by a failed start, a scheduler that says whom it
waits for."""

import subprocess
import sys

import pytest

from omnips.job import JobSpec
from omnips.protocol import Register
from omnips.scheduler.registry import Registry

from helpers import WAIT_FACTOR


def run(*argv, timeout=120):
    """`python -X importtime ARGV`: its exit code, stdout, stderr without the import lines,
    and whether torch was imported."""
    out = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True,
                         timeout=timeout)
    imports = [line for line in out.stderr.splitlines() if line.startswith("import time:")]
    err = "\n".join(line for line in out.stderr.splitlines() if not line.startswith("import time:"))
    return out.returncode, out.stdout, err, any(line.rstrip().endswith("| torch") for line in imports)


@pytest.mark.cluster
@pytest.mark.core
def test_omnips_lists_its_subcommands_and_names_an_unknown_one():
    code, out, err, _ = run("-m", "omnips.cli", "--help")
    assert code == 0 and err == ""
    for name in ("launch", "plot", "export", "keygen"):  # one line each, with what it does
        assert any(line.split()[:1] == [name] and len(line.split()) > 2 for line in out.splitlines()), out
    code, _, bare, _ = run("-m", "omnips.cli")
    assert code == 2 and bare.strip() == out.strip()
    code, _, err, _ = run("-m", "omnips.cli", "foo")
    assert code == 2 and err.splitlines()[0] == "omnips: unknown command foo" and out.strip() in err


@pytest.mark.parametrize("argv, error", [
    (["-m", "omnips.cli", "launch", "--num-worker", "2"], "unrecognized arguments: --num-worker 2"),
    (["-m", "omnips.cli", "launch", "--lr", "x"], "argument --lr: invalid float value: 'x'"),
    (["-m", "omnips.worker", "--schedular", "tcp://127.0.0.1:1"], "unrecognized arguments: --schedular tcp://127.0.0.1:1"),
    (["-m", "omnips.server", "--schedular", "tcp://127.0.0.1:1"], "unrecognized arguments: --schedular tcp://127.0.0.1:1"),
    (["-m", "omnips.worker", "--scheduler", "tcp://127.0.0.1:1", "--thread", "2"], "unrecognized arguments: --thread 2"),
    (["-m", "omnips.server"], "the following arguments are required: --scheduler"),
    (["-m", "omnips.scheduler", "--num-worker", "2"], "unrecognized arguments: --num-worker 2"),
], ids=["launch-prefix", "launch-value", "worker-typo", "server-typo", "worker-prefix", "server-missing",
        "scheduler-prefix"])
@pytest.mark.cluster
def test_a_flag_error_names_the_flag_given_and_comes_before_torch_is_imported(argv, error):
    code, out, err, torch_imported = run(*argv)
    assert code == 2 and err.splitlines()[-1].endswith(f"error: {error}"), err
    assert not torch_imported


@pytest.mark.cluster
def test_a_failed_start_leaves_no_run_directory(tmp_path):
    code, _, err, _ = run("-m", "omnips.cli", "launch", "--model", "no_such_pkg.mod:fn",
                          "--run-dir", str(tmp_path / "runs" / "r"), "--no-plots")
    assert code == 1 and "the scheduler did not start" in err and "cannot import no_such_pkg" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.cluster
def test_the_scheduler_says_whom_it_waits_for_while_the_cluster_forms(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "omnips.scheduler", "--num-workers", "2", "--register-timeout", "12",
                           "--run-dir", str(tmp_path / "r")], capture_output=True, text=True, timeout=120 * WAIT_FACTOR)
    waits = [line for line in proc.stderr.splitlines() if "waiting for 1 of 1 servers and 2 of 2 workers" in line]
    assert proc.returncode == 1 and len(waits) >= 1, proc.stderr  # every 5 s, before the timeout's failure
    assert proc.stderr.index(waits[0]) < proc.stderr.index("cluster incomplete after 12 s: missing 1 of 1 servers")


def test_missing_names_the_worker_ranks_not_in_when_every_worker_asked_for_one():
    job = JobSpec(num_workers=3, global_batch=12)
    reg = Registry(job, num_params=10, num_trained=10, total_steps=5, dead_after_s=3.0)
    reg.register(b"w", Register(role="worker", host="h", rank=1))
    assert reg.missing() == "1 of 1 servers and 2 of 3 workers (ranks 0, 2 not in)"
    reg.register(b"v", Register(role="worker", host="h"))
    reg.register(b"s", Register(role="server", host="h", endpoint="tcp://h:1"))
    assert reg.missing() == "1 of 3 workers"
