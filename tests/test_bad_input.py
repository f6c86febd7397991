"""Garbage on the wire and bad command lines: clear errors, no crash, no change of result."""

import random
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import torch
import zmq

from omnips import transport
from omnips.launch import WorkerSpec
from omnips.protocol import VERSION

from helpers import WAIT_FACTOR, finish, server_endpoint, start_cluster

JOB = ["--mode", "bsp", "--max-steps", "40", "--global-batch", "32", "--lr", "0.05", "--seed", "11"]
WORKERS = [WorkerSpec(ms_per_step=40.0), WorkerSpec(ms_per_step=40.0)]


def _garbage_messages(rng: random.Random) -> list[list[bytes]]:
    valid_push = msgpack.packb({"v": VERSION, "op": "push", "rank": 1, "step": 0, "version": 0, "batch": 4, "gen": 0,
                                "dt": "f4", "len": 3})
    return [
        [rng.randbytes(rng.randint(0, 64))],
        [rng.randbytes(8), rng.randbytes(1000)],
        [msgpack.packb({"v": 99, "op": "push"})],
        [msgpack.packb({"v": VERSION, "op": "nonsense"})],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"v": VERSION, "op": "register", "role": "root", "host": "x"})],
        [msgpack.packb({"v": VERSION, "op": "report", "rank": 0, "step": 0, "batch": 1, "compute_s": 0.1,
                        "network_s": 0.0, "wait_s": 0.0, "loss": 1.0})],
        [msgpack.packb({"v": VERSION, "op": "probe", "rank": 0, "batches": [2, 4], "seconds": [0.1, 0.2]})],  # not ours
        [valid_push, b"\x00" * 7],  # length that is not 3 float32
        [msgpack.packb({"v": VERSION, "op": "pull", "request": 1, "at": -5})],
        [msgpack.packb({"v": VERSION, "op": "init", "rank": 0, "dt": "f4", "len": 1}), b"\x00" * 4],
    ]


def _attack(cluster, run_dir) -> int:
    """Send garbage to the scheduler's and the server's ports until the job ends."""
    rng = random.Random(5)
    server = server_endpoint(run_dir)
    ctx = zmq.Context()
    socks = []
    for ep in (cluster.endpoint, server):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10)
        s.connect(ep)
        socks.append(s)
    sent = 0
    try:
        for _ in range(200):
            if cluster.poll() is not None:
                break
            for s in socks:
                for msg in _garbage_messages(rng):
                    try:
                        s.send_multipart(msg, flags=zmq.NOBLOCK)
                        sent += 1
                    except zmq.Again:
                        pass
                while s.poll(0):
                    s.recv_multipart()  # error replies
            for ep in (cluster.endpoint, server):  # raw bytes, not even ZeroMQ
                host, port = ep.removeprefix("tcp://").rsplit(":", 1)
                try:
                    with socket.create_connection((host, int(port)), timeout=2) as raw:
                        raw.sendall(rng.randbytes(200))
                except ConnectionRefusedError:  # the job ended meanwhile
                    break
            time.sleep(0.02)  # pace the attack over the whole run
    finally:
        ctx.destroy(linger=0)
    return sent


@pytest.mark.cluster
def test_garbage_during_a_run_changes_nothing(tmp_path):
    quiet = finish(start_cluster(tmp_path / "quiet", JOB, WORKERS))
    cluster = start_cluster(tmp_path / "attacked", JOB, WORKERS)
    sent = _attack(cluster, tmp_path / "attacked")
    attacked = finish(cluster)
    assert sent > 50
    assert attacked.summary["status"] == "completed"
    logs = attacked.logs()
    assert "refused" in (attacked.dir / "logs" / "server0.log").read_text()
    assert "refused" in (attacked.dir / "logs" / "scheduler.log").read_text(), logs
    want, got = torch.load(quiet.dir / "model.pt"), torch.load(attacked.dir / "model.pt")
    for k in want:
        assert torch.equal(want[k], got[k]), k  # BSP is bit-for-bit repeatable
    assert attacked.summary["final_test_accuracy"] == quiet.summary["final_test_accuracy"]


def test_a_listener_hangs_up_on_a_pre_zmtp3_greeting():
    """Garbage whose first byte is not 0xff reads as a ZMTP 1.0 greeting, a path on which
    libzmq 4.3.5 can abort the process while the socket closes; listeners refuse it."""
    ctx = zmq.Context()
    try:
        router = transport.socket(ctx, zmq.ROUTER)
        host, port = transport.bind(router, "127.0.0.1", 0).removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(b"\x01\x00")  # a ZMTP 1.0 identity frame: length 1, flags 0
            try:
                while raw.recv(64):  # until the listener hangs up
                    pass
            except TimeoutError:
                pytest.fail("the listener kept a peer that greeted in ZMTP 1.0")
        dealer = transport.socket(ctx, zmq.DEALER)
        dealer.connect(f"tcp://{host}:{port}")
        dealer.send(b"still served")
        assert router.poll(10_000)
        assert router.recv_multipart()[1] == b"still served"
    finally:
        ctx.destroy(linger=0)


def _free_port_in_use():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.cluster
def test_startup_errors_are_one_clear_line(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "summary.json").write_text("{}")
    holder = _free_port_in_use()
    port = holder.getsockname()[1]
    cases = {
        "wrong_address": (["-m", "omnips.worker", "--scheduler", f"tcp://127.0.0.1:{port}", "--ack-timeout", "1"],
                          1, "did not acknowledge the registration within 1 s"),
        "server_wrong_address": (["-m", "omnips.server", "--scheduler", f"tcp://127.0.0.1:{port}", "--ack-timeout", "1"],
                                 1, "did not acknowledge the registration within 1 s"),
        "port_in_use": (["-m", "omnips.scheduler", "--port", str(port), "--run-dir", str(tmp_path / "p")],
                        1, "port is in use"),
        "missing_dataset": (["-m", "omnips.scheduler", "--dataset", "no_such_pkg.data:load", "--run-dir", str(tmp_path / "d")],
                            1, "cannot import no_such_pkg.data"),
        "unknown_flag": (["-m", "omnips.scheduler", "--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
        "bad_controller": (["-m", "omnips.scheduler", "--batching", "dynamic", "--adjust-every", "1"], 2,
                           "--adjust-every must be >= 2"),
        "bad_slowdown": (["-m", "omnips.worker", "--scheduler", "tcp://127.0.0.1:1", "--slowdown", "0.5"], 2,
                         "slowdown below 1"),
        "no_cuda": (["-m", "omnips.worker", "--scheduler", "tcp://127.0.0.1:1", "--device", "cuda"], 1,
                    "no usable CUDA device"),
        "cluster_never_forms": (["-m", "omnips.scheduler", "--register-timeout", "2", "--heartbeat", "0.5",
                                 "--run-dir", str(tmp_path / "r")], 1, "cluster incomplete after 2 s"),
        "used_run_dir": (["-m", "omnips.scheduler", "--run-dir", str(tmp_path / "used")], 1, "already holds a run"),
        "bad_model_args": (["-m", "omnips.scheduler", "--model-args", "[1]"], 2, "must be a JSON object"),
    }
    procs = {name: subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, (argv, _, _) in cases.items()}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=60 * WAIT_FACTOR)
            _, code, text = cases[name]
            assert proc.returncode == code, (name, err)
            assert text in err, (name, err)
            assert "Traceback" not in err, (name, err)
        assert not (tmp_path / "p").exists()  # a scheduler that cannot listen leaves no run behind
    finally:
        holder.close()
        for proc in procs.values():
            proc.kill()
