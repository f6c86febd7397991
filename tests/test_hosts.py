"""End to end across emulated hosts (tests/hosts.py): network namespaces joined by a
switch, each with its own host name and TMPDIR, so only TCP connects them. The roles
are started by hand, as on real machines: the scheduler on one host, the servers on
another, workers on more."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from omnips.job import PREEMPTED_EXIT
from omnips.metrics import read_events

from helpers import WAIT_FACTOR, assert_trained_as_one_process, wait_for_event, wait_for_steps
from hosts import HostJob

pytestmark = [pytest.mark.cluster, pytest.mark.hosts]  # processes on emulated hosts
TIMEOUT_S = 150


def _start(hosts, tmp_path, job, servers=("srv",), workers=("w0", "w1"), server_args=(), worker_args=()):
    """The job with the scheduler on host "head", a server on each of `servers` and a
    worker on each of `workers` (`worker_args[i]`: worker i's own flags)."""
    names = ["head", *dict.fromkeys(servers), *workers]
    h = hosts(*names)
    run = HostJob(h, tmp_path / "run")
    run.scheduler("head", [*job, "--num-servers", str(len(servers)), "--num-workers", str(len(workers))])
    for s, host in enumerate(servers):
        run.server(f"server{s}", host, list(server_args))
    for i, host in enumerate(workers):
        # one torch thread, as omnips launch gives each: a second only contends on a shared test machine
        run.worker(f"worker{i}", host, ["--rank", str(i), "--threads", "1", *(worker_args[i] if worker_args else ())])
    return h, run


def _tcp_only(run: HostJob, hosts, servers=("srv",)) -> None:
    """Every connection to a server went over tcp to the host's address: ipc never crosses hosts."""
    want = {hosts.address(host) for host in servers}
    for name in ["scheduler", *(n for n in run.procs if n.startswith("worker"))]:
        text = run.log(name).read_text()
        chosen = re.findall(r"server \d+: connecting to (\S+) \((.*)\)", text)
        assert chosen, f"{name} logged no connection:\n{text[-2000:]}"
        for endpoint, why in chosen:
            assert endpoint.startswith("tcp://") and endpoint.split("//")[1].split(":")[0] in want, (name, endpoint)
            assert "runs on host" in why, (name, why)
        assert "ipc://" not in " ".join(e for e, _ in chosen)


def _finished(run: HostJob, code: int = 0) -> dict:
    codes = run.wait(TIMEOUT_S)
    assert all(c == code for c in codes.values()), f"exit codes {codes}\n{run.logs()}"
    return json.loads((run.run_dir / "summary.json").read_text())


# worker 1 is 3x slower; the virtual devices' times dwarf the real compute even on a loaded host
EMULATED = [["--emulate-ms-per-sample", "3"], ["--emulate-ms-per-sample", "9"]]


def test_bsp_with_dynamic_batching_across_four_hosts_trains_as_one_process(hosts, tmp_path):
    job = ["--mode", "bsp", "--batching", "dynamic", "--adjust-every", "4", "--max-steps", "40", "--global-batch",
           "64", "--lr", "0.05", "--seed", "3", "--heartbeat", "0.25"]
    h, run = _start(hosts, tmp_path, job, worker_args=EMULATED)
    s = _finished(run)
    assert s["status"] == "completed" and s["steps"] == 40 and s["worker_steps"] == [40, 40]
    b0, b1 = s["final_batches"]
    assert b0 > b1  # from 32/32: the controller saw worker 1's slower device over the network
    _tcp_only(run, h)
    joined = {e["rank"]: e["host"] for e in read_events(run.run_dir)
              if e["event"] == "membership" and e["role"] == "worker"}
    assert joined == {0: "w0", 1: "w1"}  # each host's own name
    assert_trained_as_one_process(run.run_dir, 40, 64, 0.05, seed=3)


@pytest.mark.parametrize("mode,keys", [("asp", False), ("ssp", True)])
def test_asp_and_ssp_with_dynamic_batching_across_hosts(hosts, tmp_path, mode, keys):
    job = ["--mode", mode, "--batching", "dynamic", "--adjust-every", "4", "--epochs", "1.5", "--global-batch", "64",
           "--lr", "0.05", "--seed", "3", "--heartbeat", "0.25", "--staleness", "2"]
    flags = []
    if keys:  # CURVE on every connection, the keys copied to every host (here: one shared path)
        subprocess.run([sys.executable, "-m", "omnips.cli", "keygen", str(tmp_path / "keys")], check=True,
                       capture_output=True, timeout=60 * WAIT_FACTOR)
        flags = ["--keys", str(tmp_path / "keys")]
    h, run = _start(hosts, tmp_path, [*job, *flags], server_args=flags,
                    worker_args=[[*a, *flags] for a in EMULATED])
    s = _finished(run)
    assert s["status"] == "completed" and s["samples"] >= 1.5 * 1438
    b0, b1 = s["final_batches"]
    assert b0 > b1  # from 32/32: the fast worker's batch grew (equal step times, as in BSP)
    _tcp_only(run, h)
    said = run.log("scheduler").read_text()
    assert ("connections: CURVE" in said) == keys and (keys or "plain TCP" in said)


def _link_down_at(run: HostJob) -> float:
    """The job's clock now (metrics' "t"): processes in every namespace share the monotonic clock."""
    start = next(e for e in read_events(run.run_dir) if e["event"] == "start")
    return time.monotonic() - start["clock_t0"]


def test_a_worker_host_whose_link_goes_down_is_dropped_and_rejoins_when_it_comes_back(hosts, tmp_path):
    dead_after = 3.0
    job = ["--mode", "bsp", "--max-steps", "100000", "--global-batch", "64", "--seed", "3", "--heartbeat", "0.5",
           "--dead-after", str(dead_after)]
    slow = [["--emulate-ms-per-step", "30"]] * 2
    h, run = _start(hosts, tmp_path, job, worker_args=slow)
    wait_for_steps(run.run_dir, 2 * 20, TIMEOUT_S)
    h.link("w1", up=False)
    down_t = _link_down_at(run)
    lost = wait_for_event(run.run_dir, lambda e: e["event"] == "membership" and e["change"] == "lost", 60)
    assert lost["rank"] == 1 and lost["host"] == "w1"
    assert lost["t"] - down_t >= dead_after - 0.5  # by its silence (from its last heartbeat), no sooner
    # the same command on the same host, while its cable is still out (as a supervisor restarts it);
    # the first gives up on the scheduler it cannot hear
    assert run.procs["worker1"].wait(timeout=60 * WAIT_FACTOR) == 1
    assert "no word from the scheduler" in run.log("worker1").read_text()
    run.worker("worker1-again", "w1", ["--rank", "1", "--threads", "1", "--ack-timeout", "120", *slow[1]])
    h.link("w1", up=True)
    joined = wait_for_event(run.run_dir, lambda e: e["event"] == "membership" and e["change"] == "joined"
                            and e.get("late") and e["rank"] == 1, TIMEOUT_S)
    assert joined["host"] == "w1"
    wait_for_event(run.run_dir, lambda e: e["event"] == "step" and e["worker"] == 1 and e["t"] > joined["t"] + 1,
                   TIMEOUT_S)
    events = read_events(run.run_dir)
    solo = [e["step"] for e in events if e["event"] == "step" and e["worker"] == 0 and lost["t"] < e["t"] < joined["t"]]
    assert solo, "worker 0 made no step alone: the job stopped with worker 1's link"
    before = [e for e in events if e["event"] == "step" and e["t"] <= down_t]
    print(f"link down at t={down_t:.2f} s after step {max(e['step'] for e in before)}; worker 1 lost at "
          f"t={lost['t']:.2f} s (+{lost['t'] - down_t:.2f} s, --dead-after {dead_after:g}) after its step "
          f"{lost['last_step']}; worker 0 went on alone from step {min(solo)}")
    run.procs["scheduler"].send_signal(signal.SIGUSR1)  # an endless job: ended as a preemption
    codes = {n: p.wait(timeout=60 * WAIT_FACTOR) for n, p in run.procs.items() if n != "worker1"}
    assert codes == {n: PREEMPTED_EXIT for n in codes}, (codes, run.logs())
    s = json.loads((run.run_dir / "summary.json").read_text())
    assert s["workers_lost"] == 1 and s["workers_joined"] == 1 and s["worker_steps"][0] == s["steps"]
    _tcp_only(run, h)


def test_a_server_host_cut_off_and_restarted_takes_its_shard_back_from_the_checkpoint(hosts, tmp_path):
    job = ["--mode", "bsp", "--max-steps", "60", "--global-batch", "64", "--lr", "0.05", "--seed", "3",
           "--heartbeat", "0.5", "--dead-after", "3", "--checkpoint-every", "5"]
    slow = [["--emulate-ms-per-step", "30"]] * 2
    h, run = _start(hosts, tmp_path, job, servers=("srv0", "srv1"), worker_args=slow)
    wait_for_event(run.run_dir, lambda e: e["event"] == "checkpoint" and e["complete"] and e["step"] >= 10, TIMEOUT_S)
    h.link("srv1", up=False)
    run.procs["server1"].send_signal(signal.SIGKILL)  # the host went down with it
    run.procs["server1"].wait(timeout=30 * WAIT_FACTOR)
    run.server("server1-again", "srv1")  # its supervisor starts it again; it reaches nobody yet
    lost = wait_for_event(run.run_dir, lambda e: e["event"] == "membership" and e["change"] == "lost", 60)
    assert lost["role"] == "server" and lost["host"] == "srv1"
    h.link("srv1", up=True)
    procs = {n: p for n, p in run.procs.items() if n != "server1"}
    codes = {n: p.wait(timeout=TIMEOUT_S) for n, p in procs.items()}
    assert all(c == 0 for c in codes.values()), (codes, run.logs())
    s = json.loads((run.run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["server_restores"] == 1 and s["steps"] == 60
    (rewind,) = [e for e in read_events(run.run_dir) if e["event"] == "rewind"]
    print(f"server host cut off: the job went back to step {rewind['step']}, {rewind['steps_lost']} steps lost")
    assert "restored version" in run.log("server1-again").read_text()
    _tcp_only(run, h, servers=("srv0", "srv1"))
    assert_trained_as_one_process(run.run_dir, 60, 64, 0.05, seed=3)  # nothing learned twice, nothing lost
