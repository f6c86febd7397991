"""The user-facing commands: scripts/launch_local.py and the per-role start scripts."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omnips import security, transport
from omnips.launch import LocalCluster, read_endpoint
from omnips.metrics import read_events

from helpers import WAIT_FACTOR

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent
SMALL_JOB = ["--max-steps", "15", "--global-batch", "32", "--seed", "2"]


def test_the_demo_runs_its_job_and_prints_the_summary(tmp_path):
    """scripts/demo.sh as the README's first command (its install skipped), cut to 20 steps
    with a window every 3 (so that measured steps, not the probe's few ms alone, set the
    plan); --keys, --token and --transport tcp, given after it, reach every process."""
    security.keygen(tmp_path / "keys")
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), "--run-dir", str(tmp_path / "run"), "--max-steps", "20",
         "--adjust-every", "3",
         "--keys", str(tmp_path / "keys"), "--token", "t0k3n", "--transport", "tcp"],
        capture_output=True, text=True, timeout=150 * WAIT_FACTOR, env={**os.environ, "OMNIPS_NO_SETUP": "1", "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr
    logs = {p.stem: p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log")}
    assert sorted(logs) == ["scheduler", "server0", "server1", "worker0", "worker1", "worker2"]
    assert "server 0 serves" in logs["server0"] and "server 1 serves" in logs["server1"]  # each log its own rank
    # --keys and --token reach every process: a worker without either would not be admitted
    assert "connections: CURVE, admitting the 1 client key(s)" in logs["scheduler"]
    assert "a job token is required" in logs["scheduler"] and "CURVE" in logs["server0"]
    for name in ("scheduler", "worker0", "worker1", "worker2"):  # and --transport: nobody takes a unix socket
        assert "connecting to tcp://" in logs[name] and "ipc://" not in logs[name], name
    # the default job: BSP, dynamic batching, 2 servers, 3 workers; the table on stdout
    for key, value in (("status", "completed"), ("mode", "bsp"), ("batching", "dynamic"), ("num_servers", "2"),
                       ("num_workers", "3"), ("steps", "20")):
        assert re.search(rf"^{key}\s+{value}$", out.stdout, re.M), (key, out.stdout)
    assert re.search(r"^final_batches\s+\d+ \d+ \d+$", out.stdout, re.M), out.stdout
    epochs = 20 * 64 / 1438  # of digits' training split
    progress = re.escape(f"{epochs:.2f}/{round(epochs, 4):g}") + r" .* samples/s  ETA +\S+  test acc 0\.\d{3}$"
    assert re.search(r"epoch\s+" + progress, out.stderr, re.M), out.stderr
    # worker i of the command line is rank i, on the virtual device of 1, 2 or 4 ms a sample: the
    # plan is about the equal-time one of 3 ms + 1/2/4 ms a sample, 37/18/9 (the timed sleeps carry
    # the host's noise, a few % of a step here)
    batches = json.loads((tmp_path / "run" / "summary.json").read_text())["final_batches"]
    assert sum(batches) == 64 and batches == sorted(batches, reverse=True), batches
    assert all(abs(b - want) <= 4 for b, want in zip(batches, (37, 18, 9))), batches
    # plots are drawn at the end, and `omnips plot` draws them again from the run directory
    def drawn():
        for name in ("batch", "compute", "throughput", "accuracy", "uniform"):
            png = tmp_path / "run" / "plots" / f"{name}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    drawn()
    shutil.rmtree(tmp_path / "run" / "plots")
    plot = subprocess.run([sys.executable, "-m", "omnips.cli", "plot", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60 * WAIT_FACTOR)
    assert plot.returncode == 0, plot.stderr
    drawn()


def test_plot_refuses_what_is_not_a_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "omnips.cli", "plot", str(tmp_path)], capture_output=True, text=True,
                         timeout=60 * WAIT_FACTOR)
    assert out.returncode == 1 and "not a run directory" in out.stderr


def test_launch_local_refuses_bad_flags(tmp_path):
    bad = [["--num-workers", "2", "--slowdown", "1", "2", "3"], ["--no-such-flag"], ["--num-workers", "0"]]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "launch_local.py"), *args, "--run-dir",
                               str(tmp_path / "never")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in bad]  # in parallel: each pays for importing torch
    for args, proc in zip(bad, procs):
        _, err = proc.communicate(timeout=60 * WAIT_FACTOR)
        assert proc.returncode == 2, (args, err)
        assert "error" in err
    assert not (tmp_path / "never").exists()


@pytest.mark.core
def test_start_scripts_form_a_cluster(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    sched = subprocess.Popen(["bash", str(ROOT / "scripts" / "start-scheduler.sh"), "--num-workers", "2", "--run-dir",
                              str(tmp_path / "run"), *SMALL_JOB], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    procs = []
    try:
        endpoint = read_endpoint(sched.stdout, timeout_s=60)
        assert endpoint is not None, sched.stderr.read()
        role_env = {**env, "OMNIPS_SCHEDULER": endpoint}
        many = str(os.cpu_count() + 1)  # never torch's default, which is at most the cores
        procs = [subprocess.Popen(["bash", str(ROOT / "scripts" / f"start-{role}.sh"), *extra], env=role_env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for role, extra in [("server", ["--threads", many]), ("worker", ["--threads", "1"]),
                                     ("worker", ["--threads", many])]]
        assert sched.wait(timeout=150 * WAIT_FACTOR) == 0, sched.stderr.read()
        assert all(p.wait(timeout=30 * WAIT_FACTOR) == 0 for p in procs)
    finally:
        for p in [sched, *procs]:
            p.kill()
            p.wait()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
    # each process's --threads reached torch: the count it registered with is torch's own
    threads = {(e["role"], e["pid"]): e["threads"] for e in read_events(tmp_path / "run") if e["event"] == "membership"}
    assert threads == {("server", procs[0].pid): int(many), ("worker", procs[1].pid): 1,
                       ("worker", procs[2].pid): int(many)}


def test_every_way_of_starting_a_role_sets_the_allocator(tmp_path, monkeypatch):
    """The start scripts export transport.MALLOC_ENV, the local launcher hands it to every
    process it starts, and mallopt takes the same settings (glibc here)."""
    for role in ("scheduler", "server", "worker"):
        exported = dict(re.findall(r"(MALLOC_\w+)=(\S+)", (ROOT / "scripts" / f"start-{role}.sh").read_text()))
        assert exported == transport.MALLOC_ENV, role
    assert transport.tune_malloc()
    started = []
    monkeypatch.setattr("subprocess.Popen", lambda args, env, **kw: started.append(env))
    LocalCluster(tmp_path, scheduler_args=[], num_servers=1, workers=[])._spawn("server0", "omnips.server", [])
    assert started and all(started[0][k] == v for k, v in transport.MALLOC_ENV.items())


def test_the_gpu_check_runs_its_mixed_job_and_checks_it(tmp_path):
    """scripts/gpu_check.sh's job and checks, with a CPU worker where the CUDA one goes (the
    CUDA path runs on a GPU machine); without CUDA the script says so and checks nothing."""
    env = {**os.environ, "PYTHON": sys.executable, "RUN_DIR": str(tmp_path / "run")}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=300 * WAIT_FACTOR, env={**env, "GPU_CHECK_DEVICE": "cpu"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    said = [line for line in run.stdout.splitlines() if line.startswith("gpu_check: ")]
    assert len(said) == 1 and "devices ['cpu', 'cpu', 'cpu'], plan [" in said[0], run.stdout[-2000:]
    import torch
    if not torch.cuda.is_available():
        bare = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                              timeout=120 * WAIT_FACTOR, env=env)
        assert bare.returncode == 2 and "no CUDA device here" in bare.stderr, bare.stderr
