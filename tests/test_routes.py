"""Servers on this host are reached over their unix socket (ipc://), others over tcp."""

import os
import shutil
import socket as pysocket
import stat
import time

import pytest
import zmq

from omnips import routes, security, transport
from omnips.cli import launch_parser
from omnips.launch import LocalCluster, WorkerSpec
from omnips.scheduler.__main__ import parser as scheduler_parser
from omnips.worker.__main__ import parse as worker_parse

from helpers import assert_trained_as_one_process, finish

TCP, IPC = "tcp://10.0.0.5:4000", "ipc:///tmp/omnips-abc/sock"


def always(path):
    return True


@pytest.mark.parametrize("server_host, transport_, can_open, want, why", [
    ("box", "auto", always, IPC, "same host"),
    ("other", "auto", always, TCP, "runs on host 'other'"),
    ("box", "tcp", always, TCP, "--transport tcp"),
    ("box", "auto", lambda path: False, TCP, "cannot open /tmp/omnips-abc/sock"),
])
def test_a_client_takes_ipc_only_on_the_servers_host_unless_tcp_is_forced(server_host, transport_, can_open,
                                                                         want, why):
    endpoint, reason = routes.choose(TCP, server_host, IPC, "box", transport_, can_open)
    assert endpoint == want and why in reason


def test_a_server_without_ipc_or_a_scheduler_that_sends_none_means_tcp():
    assert routes.choose(TCP, "box", "", "box", "auto", always) == (TCP, "the server offers no ipc endpoint")
    assert routes.endpoints([TCP, "tcp://h:2"], [], "auto") == [TCP, "tcp://h:2"]


def test_an_unknown_transport_is_refused():  # (malformed endpoint lists: the codec refuses them, test_welcome)
    with pytest.raises(ValueError, match="transport must be one of auto, tcp, not 'udp'"):
        routes.endpoints([TCP], [], "udp")


def test_the_transport_flag_defaults_to_the_environment_and_refuses_other_values(monkeypatch, capsys):
    assert worker_parse(["--scheduler", "tcp://h:1"]).transport == "auto"
    assert scheduler_parser().parse_args(["--transport", "tcp"]).transport == "tcp"
    args, to_scheduler = launch_parser().parse_known_args(["--transport", "tcp", "--mode", "asp"])
    assert args.transport == "tcp" and to_scheduler == ["--mode", "asp"]  # launch hands it to every process
    monkeypatch.setenv("OMNIPS_TRANSPORT", "tcp")
    assert worker_parse(["--scheduler", "tcp://h:1"]).transport == "tcp"
    monkeypatch.setenv("OMNIPS_TRANSPORT", "udp")
    with pytest.raises(SystemExit):
        worker_parse(["--scheduler", "tcp://h:1"])
    assert "OMNIPS_TRANSPORT='udp': use one of auto, tcp" in capsys.readouterr().err


def test_a_bound_ipc_socket_lives_in_a_private_directory(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    killed = tmp_path / f"{transport.IPC_PREFIX}killed"  # a killed server's: the next bind sweeps it away
    killed.mkdir(mode=0o700)
    dead = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    dead.bind(str(killed / "sock"))
    dead.close()
    made = time.time() - 2 * transport.SWEEP_AFTER_S
    os.utime(killed / "sock", (made, made))
    ctx = zmq.Context()
    endpoint, directory = transport.bind_ipc(transport.socket(ctx, zmq.ROUTER))
    try:
        assert not killed.exists() and os.path.dirname(directory) == str(tmp_path)
        path = endpoint.removeprefix("ipc://")
        assert os.path.dirname(path) == directory and stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert routes.can_open(path) and not routes.can_open(directory) and not routes.can_open(str(tmp_path / "x"))
        hosts = [["elsewhere", endpoint], [pysocket.gethostname(), endpoint]]
        assert routes.endpoints([TCP, TCP], hosts, "auto") == [TCP, endpoint]
        assert routes.endpoints([TCP, TCP], hosts, "tcp") == [TCP, TCP]
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(directory)


def test_a_killed_servers_socket_directory_is_swept_and_a_live_ones_is_kept(tmp_path):
    old = time.time() - 2 * transport.SWEEP_AFTER_S

    def directory(name, listening, made=old):
        d = tmp_path / f"{transport.IPC_PREFIX}{name}"
        d.mkdir(mode=0o700)
        s = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        s.bind(str(d / "sock"))
        os.utime(d / "sock", (made, made))
        if listening:
            s.listen()
            return d, s
        s.close()  # the socket file stays, as after a SIGKILL: nobody listens on it
        return d, None

    stale, _ = directory("dead", listening=False)
    live, listener = directory("live", listening=True)
    (tmp_path / f"{transport.IPC_PREFIX}starting").mkdir()  # between mkdtemp and bind
    binding, _ = directory("binding", listening=False, made=time.time())  # bound, not listening yet
    other, _ = directory("other", listening=False)
    (other / "notes").write_text("not a server's directory")
    for name, make in (("file", lambda p: p.write_text("data")), ("dir", lambda p: p.mkdir())):
        d = tmp_path / f"{transport.IPC_PREFIX}{name}"  # a sock that is no socket refuses a connection too
        d.mkdir()
        make(d / "sock")
        os.utime(d / "sock", (old, old))
    (tmp_path / "unrelated").mkdir()
    try:
        assert transport.sweep_stale_ipc(str(tmp_path)) == [str(stale)]
    finally:
        listener.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [live.name, f"{transport.IPC_PREFIX}starting", binding.name, other.name, f"{transport.IPC_PREFIX}file",
         f"{transport.IPC_PREFIX}dir", "unrelated"])


def test_a_socket_path_too_long_for_unix_sockets_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    ctx = zmq.Context()
    try:
        with pytest.raises(transport.TransportError, match="set TMPDIR to a shorter directory"):
            transport.bind_ipc(transport.socket(ctx, zmq.ROUTER))
    finally:
        ctx.destroy(linger=0)
    assert not list(deep.iterdir())


JOB = ["--mode", "bsp", "--max-steps", "6", "--global-batch", "32", "--seed", "5"]
UNREACHABLE = ["--advertise", "192.0.2.1"]  # TEST-NET-1: nothing answers there, so tcp clients would hang


@pytest.mark.cluster
def test_on_one_host_the_job_runs_over_ipc_alone_with_curve(tmp_path):
    """The servers advertise a tcp address nobody answers at: the job completes only if
    the worker and the scheduler really talk to them over their unix sockets, here with
    --keys (CURVE on ipc as on tcp). Plain ipc is what every other end-to-end test runs."""
    key_dir = tmp_path / "keys"
    security.keygen(key_dir)
    cluster = LocalCluster(tmp_path / "run", JOB, 2, [WorkerSpec()], server_args=UNREACHABLE, keys=key_dir)
    run = finish(cluster.start())
    assert run.summary["status"] == "completed" and run.summary["steps"] == 6
    assert_trained_as_one_process(run.dir, steps=6, global_batch=32, lr=0.05, seed=5)
    servers = [e for e in run.events if e["event"] == "membership" and e["role"] == "server"]
    sockets = [e["ipc"].removeprefix("ipc://") for e in servers]
    assert len(sockets) == 2 and all(e["endpoint"].startswith("tcp://192.0.2.1:") for e in servers)
    assert not any(os.path.exists(os.path.dirname(p)) for p in sockets)  # removed at exit
    logs = {p.stem: p.read_text() for p in (run.dir / "logs").glob("*.log")}
    for name in ("scheduler", "worker0"):
        for s, path in enumerate(sockets):
            assert logs[name].count(f"server {s}: connecting to ipc://{path} (same host)") == 1, logs[name]


@pytest.mark.cluster
def test_forced_tcp_keeps_every_connection_on_tcp(tmp_path):
    cluster = LocalCluster(tmp_path / "run", JOB, 1, [WorkerSpec()], env={"OMNIPS_TRANSPORT": "tcp"})
    run = finish(cluster.start())
    assert run.summary["status"] == "completed"
    logs = {p.stem: p.read_text() for p in (run.dir / "logs").glob("*.log")}
    for name in ("scheduler", "worker0"):
        assert "server 0: connecting to tcp://127.0.0.1:" in logs[name] and "connecting to ipc://" not in logs[name]
