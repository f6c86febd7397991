"""Keys, the allow-list, the job token and the exposure warning; a keyed job that only
key holders can reach."""

import logging
import re
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from omnips import access, cli, codec, protocol, security, transport
from omnips.job import JobSpec
from omnips.launch import LocalCluster, WorkerSpec
from omnips.link import LinkError, SchedulerLink
from omnips.protocol import Init, Pull, Push, Register
from omnips.security import Gate, Keys, KeysError
from omnips.scheduler.__main__ import parser as scheduler_parser
from omnips.scheduler.registry import Registry
from omnips.scheduler.service import Scheduler, SchedulerOptions
from omnips.server.__main__ import parse as server_parse
from omnips.worker.__main__ import parse as worker_parse

from helpers import WAIT_FACTOR, assert_trained_as_one_process, finish, server_endpoint, wait_for_event

JOB = ["--mode", "bsp", "--max-steps", "10", "--global-batch", "32", "--seed", "5"]
ANSWER_S = 1.0  # how long a refused client waits: a CURVE handshake on loopback takes milliseconds


# -- keys ------------------------------------------------------------------------------
def test_keygen_writes_two_private_pairs_and_an_allow_list_and_never_overwrites(tmp_path, capsys):
    d = tmp_path / "keys"
    assert cli.main(["keygen", str(d)]) == 0
    assert "--keys" in capsys.readouterr().out
    names = {p.relative_to(d).as_posix() for p in d.rglob("*")}
    assert names == {"server.key", "server.key_secret", "client.key", "client.key_secret", "authorized",
                     "authorized/client.key"}
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((d / f).stat().st_mode) == 0o600 for f in ("server.key_secret", "client.key_secret"))
    keys = Keys.load(d, listens=True)
    assert keys.allowed == {keys.client_public} and keys.server_secret is not None
    assert keys.client_secret.decode() not in repr(keys) and keys.server_secret.decode() not in repr(keys)
    before = (d / "server.key_secret").read_bytes()
    assert cli.main(["keygen", str(d)]) == 1
    assert "refusing to overwrite" in capsys.readouterr().err
    assert (d / "server.key_secret").read_bytes() == before


def test_a_client_key_for_one_machine_holds_no_server_secret_and_joins_the_allow_list(tmp_path, capsys):
    d = tmp_path / "keys"
    security.keygen(d)
    assert cli.main(["keygen", str(d), "--client", "gpu-box.1"]) == 0
    machine = d / "clients" / "gpu-box.1"
    assert {p.name for p in machine.iterdir()} == {"server.key", "client.key", "client.key_secret"}
    mine = Keys.load(machine, listens=False)
    assert mine.client_public in Keys.load(d, listens=True).allowed
    (d / "authorized" / "gpu-box.1.key").unlink()  # shut it out: from the next start on
    assert mine.client_public not in Keys.load(d, listens=True).allowed
    with pytest.raises(KeysError, match="holds no server.key_secret"):
        Keys.load(machine, listens=True)
    for argv, text in [(["--client", "gpu-box.1"], "exists already"), (["--client", "../x"], "client name"),
                       (["--client", "client"], "client name")]:
        assert cli.main(["keygen", str(d), *argv]) == 1
        assert text in capsys.readouterr().err
    assert cli.main(["keygen", str(tmp_path / "none"), "--client", "w"]) == 1
    assert "make them first" in capsys.readouterr().err


def test_keygen_does_not_write_a_secret_through_a_link_left_in_the_directory(tmp_path):
    d, elsewhere = tmp_path / "keys", tmp_path / "elsewhere"
    d.mkdir()
    (d / "server.key_secret").symlink_to(elsewhere / "stolen")  # dangling: exists() says False
    with pytest.raises(KeysError, match=r"already holds keys \(server.key_secret\)"):
        security.keygen(d)
    assert not elsewhere.exists() and [p.name for p in d.iterdir()] == ["server.key_secret"]


def _broken(d, case):
    security.keygen(d)
    if case == "no_dir":
        return d / "nothing"
    if case == "no_server_key":
        (d / "server.key").unlink()
    elif case == "garbage":
        (d / "client.key_secret").write_text("curve\n    public-key = \"x\"\n")
    elif case == "public_only":
        (d / "client.key_secret").write_text((d / "client.key").read_text())
    elif case == "empty_allow_list":
        (d / "authorized" / "client.key").unlink()
    elif case == "key_too_large":  # z85 text whose value is over 32 bits
        (d / "authorized" / "client.key").write_text('curve\n    public-key = "' + "#" * 40 + '"\n')
    elif case == "line_without_equals":
        (d / "authorized" / "client.key").write_text("curve\n    public-key\n")
    return d


@pytest.mark.parametrize("case,text", [("no_dir", "does not exist"), ("no_server_key", "missing key file"),
                                       ("garbage", "holds no valid secret key"),
                                       ("public_only", "holds no valid secret key"),
                                       ("empty_allow_list", "holds no *.key file"),
                                       ("key_too_large", "holds no valid public key"),
                                       ("line_without_equals", "is not a CURVE key file")])
def test_a_key_directory_that_cannot_work_is_one_clear_line(tmp_path, case, text, capsys):
    path = _broken(tmp_path / "keys", case)
    with pytest.raises(KeysError, match=text.replace("*", r"\*")):
        Keys.load(path, listens=True)
    with pytest.raises(SystemExit) as exit_:  # every role's --keys checks it before anything starts
        server_parse(["--scheduler", "tcp://127.0.0.1:1", "--keys", str(path)])
    assert exit_.value.code == 2 and text in capsys.readouterr().err


# -- the exposure warning --------------------------------------------------------------
@pytest.mark.parametrize("host,want", [("127.0.0.1", False), ("127.3.2.1", False), ("::1", False), ("[::1]", False),
                                       ("localhost", False), ("0.0.0.0", True), ("*", True), ("::", True),
                                       ("10.0.0.5", True), ("eth0", True), ("head.example.org", True)])
def test_only_loopback_counts_as_unexposed(host, want):
    assert access.exposed(host) is want


def test_every_role_binds_loopback_unless_told_otherwise():
    assert not access.exposed(scheduler_parser().parse_args([]).host)
    assert not access.exposed(server_parse(["--scheduler", "tcp://127.0.0.1:1"]).host)


def test_binding_a_reachable_address_without_keys_logs_a_loud_warning(tmp_path, caplog):
    security.keygen(tmp_path / "keys")
    keys = Keys.load(tmp_path / "keys", listens=True)
    ctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="omnips.transport"):
            for host, with_keys in (("0.0.0.0", None), ("127.0.0.1", None), ("0.0.0.0", keys)):
                transport.bind(transport.socket(ctx, zmq.ROUTER), host, 0, with_keys)
    finally:
        ctx.destroy(linger=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("listening on tcp://0.0.0.0:")
    assert "anyone who can reach this port can join the job, read the model and change it" in warnings[0]
    assert "omnips keygen DIR" in warnings[0] and "--keys DIR" in warnings[0]


# -- the job token ---------------------------------------------------------------------
def test_the_registry_refuses_another_jobs_token_first_and_never_repeats_it():
    registry = Registry(JobSpec(num_workers=1), 100, 100, 10, 30.0, token="job-a")
    for token in ("", "job-b", "job-a ", "jöb-a"):
        [(peer, reply)] = registry.register(b"p", Register(role="worker", host="h", token=token))
        assert reply.code == "bad_token" and "job-" not in reply.text and "jöb" not in reply.text
    assert not registry.by_peer
    assert isinstance(registry.register(b"p", Register(role="worker", host="h", token="job-a"))[0][1], protocol.Ack)
    reg = Register(role="worker", host="h", token="job-a")
    assert "job-a" not in repr(reg)
    assert codec.decode(codec.encode(reg)).token == "job-a"
    tokenless = Registry(JobSpec(num_workers=1), 100, 100, 10, 30.0)
    assert tokenless.register(b"p", Register(role="worker", host="h", token="x"))[0][1].code == "bad_token"


def test_the_token_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("OMNIPS_TOKEN", "from-env")
    assert worker_parse(["--scheduler", "tcp://127.0.0.1:1"]).token == "from-env"
    assert worker_parse(["--scheduler", "tcp://127.0.0.1:1", "--token", "flag"]).token == "flag"


# -- CURVE on the wire -----------------------------------------------------------------
def _stranger(keys: Keys) -> Keys:
    """Keys that know the job's server key but whose client pair is not on the allow-list."""
    public, secret = zmq.curve_keypair()
    return Keys(keys.path, keys.server_public, public, secret)


def _who_is_heard(ctx, endpoint: str, keys: Keys, attack: list) -> dict:
    """Send `attack` from a client without keys and from one with an unknown key, and a
    garbage message (answered with an error, changing nothing) from one with the job's key;
    which of them got any answer."""
    clients = {"no key": None, "unknown key": _stranger(keys), "allowed key": keys}
    socks = {}
    for name, k in clients.items():
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        transport.connect(sock, endpoint, k)
        for msg in attack if k is not keys else [[b"\x00"]]:
            try:
                sock.send_multipart(msg if isinstance(msg, list) else codec.encode(msg), flags=zmq.NOBLOCK)
            except zmq.Again:
                # a handshake already refused leaves the socket no peer to queue for: unheard too
                assert k is not keys, "the allowed client could not queue its message"
        socks[name] = sock
    heard = {"allowed key": bool(socks["allowed key"].poll(10_000))}  # the listener is up and answering
    heard.update({name: bool(socks[name].poll(int(ANSWER_S * 1000))) for name in ("no key", "unknown key")})
    return heard


def test_a_gate_admits_only_allowed_keys_and_stops_cleanly(tmp_path, caplog):
    security.keygen(tmp_path / "keys")
    keys = Keys.load(tmp_path / "keys", listens=True)
    threads = threading.active_count()
    ctx = zmq.Context()
    gate = Gate(ctx, keys)
    router = transport.socket(ctx, zmq.ROUTER)
    endpoint = transport.bind(router, "127.0.0.1", 0, keys)
    replies = []

    def answer():  # the listener's loop: error replies to whatever comes
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(replies) < 1:
            if router.poll(100):
                peer, *_ = router.recv_multipart()
                router.send_multipart([peer, b"answer"])
                replies.append(peer)

    listener = threading.Thread(target=answer)
    with caplog.at_level(logging.WARNING, logger="omnips.security"):
        listener.start()
        heard = _who_is_heard(ctx, endpoint, keys, [[b"hello"]])
        listener.join(timeout=20)
    assert heard == {"allowed key": True, "no key": False, "unknown key": False}
    refusals = [r.getMessage() for r in caplog.records if "not in the allow-list" in r.getMessage()]
    assert len(refusals) == 1  # logged once per key
    gate.stop()
    late = ctx.socket(zmq.DEALER)
    transport.connect(late, endpoint, keys)
    late.send(b"hello")
    assert not router.poll(int(ANSWER_S * 1000))  # without its gate a listener admits nobody
    late.close(linger=0)  # its message never left: it would hold the context for its linger
    ctx.destroy(linger=transport.LINGER_MS)
    assert threading.active_count() == threads  # no thread left


def test_a_process_refused_at_the_handshake_says_why_at_once(tmp_path):
    for name in ("keys", "other"):
        security.keygen(tmp_path / name)
    keys, other = Keys.load(tmp_path / "keys", listens=True), Keys.load(tmp_path / "other", listens=True)
    ctx = zmq.Context()
    gate = Gate(ctx, keys)
    try:
        listeners = [transport.socket(ctx, zmq.ROUTER) for _ in range(2)]  # referenced: collected would close
        keyed = transport.bind(listeners[0], "127.0.0.1", 0, keys)
        plain = transport.bind(listeners[1], "127.0.0.1", 0)
        stranger = _stranger(keys)
        cases = [(keyed, stranger, f"refused this process's client key {stranger.client_public.decode()}"),
                 (keyed, None, "start this process with --keys too"),
                 (keyed, other, "start every process with keys from the same 'omnips keygen', or none"),
                 (plain, keys, "start every process with keys from the same 'omnips keygen', or none")]
        for endpoint, client_keys, text in cases:
            # the refusal's own reason, not the 10 s timeout of a scheduler that is not there
            with pytest.raises(LinkError, match=re.escape(f"cannot join the scheduler at {endpoint}: ") + ".*" + re.escape(text)):
                SchedulerLink(ctx, endpoint, keys=client_keys).register(Register(role="worker", host="h"), 10, 10)
    finally:
        gate.stop()
        ctx.destroy(linger=0)


def test_one_machines_client_key_registers_a_worker_but_no_server(tmp_path):
    """Such a machine holds no server secret: a shard taken by it would never be served."""
    d = tmp_path / "keys"
    security.keygen(d)
    machine = Keys.load(security.keygen_client(d, "box"), listens=False)
    job = JobSpec(num_workers=1, num_servers=1)
    s = Scheduler(job, SchedulerOptions(run_dir=str(tmp_path / "run"), keys=Keys.load(d, listens=True)),
                  announce=lambda *a: None)
    try:
        replies = {}
        for name, keys, role in [("box server", machine, "server"), ("box worker", machine, "worker"),
                                 ("job server", Keys.load(d, listens=True), "server")]:
            sock = transport.socket(s.ctx, zmq.DEALER)
            transport.connect(sock, s.endpoint, keys)
            transport.send(sock, Register(role=role, host="h", endpoint="tcp://127.0.0.1:1" if role == "server" else ""))
            assert s.router.poll(10_000), name
            s.receive()
            assert sock.poll(10_000), name
            replies[name] = codec.decode(sock.recv_multipart())
            sock.close(linger=0)
        assert replies["box server"].code == "bad_key" and "--client" in replies["box server"].text
        assert all(type(replies[name]).__name__ != "Error" for name in ("box worker", "job server"))
        assert sorted(m.role for m in s.core.registry.by_peer.values()) == ["server", "worker"]
    finally:
        s._close(linger=0)


# -- a keyed job -----------------------------------------------------------------------
def _spawn(*argv) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.cluster
@pytest.mark.core
def test_with_keys_only_key_holders_are_heard_and_the_job_is_unaffected(tmp_path):
    """While the cluster forms, impostors knock: at the scheduler (registrations) and at
    the server (init, pull and push of the right size: any of them heard would change or
    break the job); a server process without keys and a worker with another job's
    token are started. Then the job runs, one worker on its own machine key, to the
    model that single-process training reaches."""
    key_dir = tmp_path / "keys"
    security.keygen(key_dir)
    keys = Keys.load(key_dir, listens=True)
    machine = security.keygen_client(key_dir, "w1")
    reachable = ["--host", "0.0.0.0", "--advertise", "127.0.0.1"]  # the warning is due only without keys
    cluster = LocalCluster(tmp_path / "run", JOB, 1, [WorkerSpec(), WorkerSpec(extra=("--keys", str(machine)))],
                           server_args=reachable, keys=key_dir, env={"OMNIPS_TOKEN": "job-a"})
    ctx, impostors = zmq.Context(), {}
    try:
        cluster.start_scheduler()
        cluster.start_servers()
        impostors = {"no keys": _spawn("server", "--scheduler", cluster.endpoint, *reachable),
                     "wrong token": _spawn("worker", "--scheduler", cluster.endpoint, "--keys", str(key_dir),
                                           "--token", "job-b")}
        n = wait_for_event(cluster.run_dir, lambda e: e["event"] == "start")["num_params"]
        joins = [Register(role=role, host="impostor", endpoint="tcp://127.0.0.1:1", token="job-a")
                 for role in ("server", "worker")]
        assert _who_is_heard(ctx, cluster.endpoint, keys, joins) == {
            "allowed key": True, "no key": False, "unknown key": False}
        values = np.zeros(n, dtype=np.float32)
        tamper = [Init(rank=0, data=values), Pull(request=1), Push(rank=1, step=0, version=0, batch=1, gen=0, data=values)]
        assert _who_is_heard(ctx, server_endpoint(cluster.run_dir), keys, tamper) == {
            "allowed key": True, "no key": False, "unknown key": False}
        errors = {name: p.communicate(timeout=60 * WAIT_FACTOR)[1] for name, p in impostors.items()}
        assert all(p.returncode == 1 for p in impostors.values()), errors
        assert f"cannot join the scheduler at {cluster.endpoint}: " in errors["no keys"]
        assert "start this process with --keys too" in errors["no keys"]
        assert "anyone who can reach this port" in errors["no keys"]
        assert "scheduler refused us: bad_token: the job token differs" in errors["wrong token"]
        assert "job-b" not in errors["wrong token"] and not any("Traceback" in e for e in errors.values())
        cluster.start_workers()
        run = finish(cluster)
    finally:
        ctx.destroy(linger=0)
        for p in impostors.values():
            p.kill()
            p.wait()
        cluster.stop(grace_s=0)
    assert run.summary["status"] == "completed" and run.summary["steps"] == 10
    assert_trained_as_one_process(run.dir, steps=10, global_batch=32, lr=0.05, seed=5)
    logs = {p.stem: p.read_text() for p in (run.dir / "logs").glob("*.log")}
    assert "job-a" not in "".join(logs.values())  # the token is never logged
    for name in ("scheduler", "server0"):
        assert "not in the allow-list" in logs[name]
    assert "refused a registration: the job token differs" in logs["scheduler"]
    assert "anyone who can reach this port" not in logs["server0"]
