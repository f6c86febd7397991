"""The status server's pure parts: events -> snapshot (omnips.status), snapshot -> Prometheus
text and JSON, the token check, routes, --status-port; and `omnips status` on a run's files.
One test starts the HTTP driver on loopback port 0 (no job)."""

import json
import re
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnips import status_view
from omnips.status import StatusBook, eta_s
from omnips.scheduler.__main__ import parser as scheduler_parser
from omnips.scheduler.status_metrics import exposition, registry
from omnips.scheduler.status_server import (PAGE, Rendered, StatusPublisher, StatusServer, authorized, open_status, route,
                                     status_port)

JOB = {"mode": "bsp", "batching": "dynamic", "num_workers": 2, "num_servers": 2, "global_batch": 8,
       "model": "mlp", "dataset": "digits"}


def events():
    worker = {"event": "membership", "change": "joined", "role": "worker", "device": "cpu"}
    yield {"event": "start", "t": 0.0, "num_params": 11, "train_size": 80, "budget_epochs": 1.0}
    yield {"event": "membership", "t": 0.1, "change": "joined", "role": "server", "rank": 0, "host": "s0"}
    yield {"event": "membership", "t": 0.1, "change": "joined", "role": "server", "rank": 1, "host": "s1"}
    yield {**worker, "t": 0.2, "rank": 0, "host": "a"}
    yield {**worker, "t": 0.2, "rank": 1, "host": "b"}
    yield {"event": "assign", "t": 0.3, "gen": 0, "batches": [4, 4], "reason": "start", "step": 0}
    for step in range(4):
        for rank, compute in ((0, 0.01), (1, 0.03)):
            yield {"event": "step", "t": 1.0 + step + rank * 0.01, "worker": rank, "step": step, "batch": 4,
                   "epoch": (2 * step + rank + 1) * 4 / 80, "compute_s": compute, "network_s": 0.005,
                   "overhead_s": 0.005, "wait_s": 0.035 - compute, "loss": 1.0, "staleness": 0, "mem_batch": 0,
                   "mem_free": 1 << 30, "sample_bytes": 100}
        if step == 1:
            yield {"event": "assign", "t": 2.5, "gen": 1, "batches": [5, 3], "reason": "window", "step": 2,
                   "max_batch": [8, 6]}
    yield {"event": "eval", "t": 4.5, "epoch": 0.4, "versions": [4, 4], "test_accuracy": 0.75, "test_loss": 0.9}


def book(upto=None) -> StatusBook:
    b = StatusBook(JOB, "runs/x", unix_t0=1000.0)
    for e in list(events())[:upto]:
        b.add(e)
    return b


def test_the_snapshot_folds_the_events_into_progress_rows_servers_and_the_plan():
    s = book().snapshot()
    p = s["progress"]
    assert (p["steps"], p["samples"], p["epoch"], p["fraction"]) == (4, 32, 0.4, 0.4)
    assert p["last_step_t"] == 4.01 and p["last_step_unix"] == 1004.01
    assert p["eta_s"] == pytest.approx((1 - 0.4) * (4.01 - 1.0) / (0.4 - 0.05))  # the rate since the first step
    assert [(w["rank"], w["host"], w["state"], w["batch"], w["mem_bound"]) for w in s["workers"]] == \
        [(0, "a", "training", 4, 8), (1, "b", "training", 4, 6)]
    w1 = s["workers"][1]
    assert w1["compute_ms"] == pytest.approx(30) and w1["step_ms"] == pytest.approx(40)
    assert w1["wait_share"] == pytest.approx(0.25) and w1["mem_free_bytes"] == 1 << 30
    assert s["straggler"] == 1 and s["waits_for"] is None  # slowest by compute; waits_for is the scheduler's, later
    assert [(v["rank"], v["host"], v["shard"], v["version"]) for v in s["servers"]] == \
        [(0, "s0", [0, 6], 4), (1, "s1", [6, 11], 4)]
    assert s["plan"]["gen"] == 1 and s["plan_changes_by_reason"] == {"window": 1}  # the start plan is no change
    assert [c["gen"] for c in s["plan_changes"]] == [0, 1]
    assert s["test_accuracy"] == 0.75 and s["series"]["accuracy"] == [(4.5, 0.4, 0.75)]
    assert [t for t, _ in s["series"]["step_time"]] == [1.0, 2.0, 3.0, 4.0]  # one point per step
    assert s["events"][-1]["text"] == "epoch 0.40: test accuracy 0.7500"
    assert s["events_total"] == len(list(events())) and s["state"] == "running"


def test_a_run_written_before_steps_carried_their_overhead_reads_its_network_time_instead():
    b = StatusBook(JOB, "runs/x", unix_t0=1000.0)
    for e in events():
        b.add({k: v for k, v in e.items() if k != "overhead_s"})
    w1 = b.snapshot()["workers"][1]
    assert w1["compute_ms"] == pytest.approx(30) and w1["step_ms"] == pytest.approx(40)


def test_a_lost_worker_is_struck_off_the_metrics_and_a_finished_job_reads_completed():
    b = book()
    b.add({"event": "membership", "t": 5, "change": "lost", "role": "worker", "rank": 1, "host": "b",
                "reason": "silent for 30 s"})
    s = b.snapshot()
    assert s["workers"][1]["state"] == "lost" and s["straggler"] is None
    ranks = {f.name: [x.labels.get("rank") for x in f.samples] for f in parse(s)}
    assert ranks["omnips_worker_batch"] == ["0"]
    b.add({"event": "end", "t": 6, "status": "completed"})
    s = b.snapshot()
    assert s["state"] == "completed" and s["progress"]["fraction"] == 1.0 and s["progress"]["eta_s"] is None
    assert [w["state"] for w in s["workers"]] == ["finished", "lost"]


def test_eta_needs_two_points_of_rising_progress():
    assert eta_s([]) is None and eta_s([(0, 0.1)]) is None and eta_s([(0, 0.1), (1, 0.1)]) is None
    assert eta_s([(0, 0.2), (10, 0.4)]) == pytest.approx(30)


def parse(snap):
    return list(text_string_to_metric_families(exposition(registry(lambda: snap)).decode()))


def test_the_metrics_follow_prometheus_names_and_leave_out_what_is_not_known():
    fams = {f.name: f for f in parse(book().snapshot())}
    assert fams["omnips_steps"].type == "counter" and fams["omnips_steps"].samples[0].name == "omnips_steps_total"
    value = {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in fams.values() for s in f.samples}
    assert value["omnips_steps_total{}"] == 4 and value["omnips_samples_total{}"] == 32
    assert value["omnips_epoch{}"] == 0.4 and value["omnips_test_accuracy{}"] == 0.75
    assert value['omnips_plan_changes_total{"reason": "window"}'] == 1
    assert value["omnips_last_step_timestamp_seconds{}"] == 1004.01
    assert value['omnips_worker_compute_seconds{"rank": "1"}'] == pytest.approx(0.03)
    assert value['omnips_worker_wait_ratio{"rank": "0"}'] == pytest.approx(0.75)
    assert value['omnips_worker_free_memory_bytes{"rank": "0"}'] == 1 << 30
    assert value['omnips_worker_batch{"rank": "1"}'] == 4 and value['omnips_worker_staleness{"rank": "1"}'] == 0
    early = {f.name: f for f in parse(book(upto=1).snapshot())}  # before any step or evaluation
    assert "omnips_test_accuracy" not in early and "omnips_last_step_timestamp_seconds" not in early
    assert early["omnips_worker_batch"].samples == []


def test_routes_serve_the_page_json_and_metrics_and_404_anything_else():
    snap = book().snapshot()
    bodies = Rendered(lambda: snap)
    code, kind, body = route("/status.json", b"<html>", bodies)
    assert code == 200 and kind == "application/json" and json.loads(body)["progress"]["steps"] == 4
    assert route("/", b"<html>", bodies)[:3] == (200, "text/html; charset=utf-8", b"<html>")
    metrics = route("/metrics", b"", bodies)[2]
    assert b"omnips_steps_total 4.0" in metrics
    assert route("/metrics", b"", bodies)[2] is metrics  # made once per snapshot
    assert route("/admin", b"", bodies)[0] == 404


def test_the_token_is_asked_for_by_bearer_header_or_query_when_the_job_has_one():
    assert authorized("", None, "")
    assert authorized("s3cret", "Bearer s3cret", "") and authorized("s3cret", None, "token=s3cret&x=1")
    assert not authorized("s3cret", None, "") and not authorized("s3cret", "Bearer wrong", "token=s3cret")
    assert not authorized("s3cret", None, "token=s3cre")


def test_status_port_takes_a_port_or_off_and_off_starts_no_server():
    assert status_port("0") == 0 and status_port("8080") == 8080 and status_port("OFF") is None
    with pytest.raises(Exception, match="or 'off'"):
        status_port("http")
    a = scheduler_parser().parse_args(["--status-port", "off"])
    assert a.status_port is None and a.status_host == "127.0.0.1"
    assert scheduler_parser().parse_args(["--status-host", "[::1]"]).status_host == "::1"
    assert scheduler_parser().parse_args([]).status_port == 0  # on by default, on a free port
    off = open_status(JOB, "runs/x", "127.0.0.1", None, "")
    assert off.url is None
    off.tick(0.0), off.close()


def get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_server_answers_with_the_published_snapshot_and_refuses_a_missing_token():
    pub = StatusPublisher(JOB, "runs/x", "127.0.0.1", 0, "tok")
    try:
        for e in events():
            pub.add(e)
        assert json.loads(get(pub.url + "status.json", "tok")[1])["progress"]["steps"] == 0  # not published yet
        pub.tick(now=1.0)
        assert json.loads(get(pub.url + "status.json", "tok")[1])["progress"]["steps"] == 4
        code, body = get(pub.url + "metrics")
        assert code == 401 and b"token" in body
        assert get(pub.url + "metrics?token=tok")[0] == 200
        assert get(pub.url + "nope", "tok")[0] == 404
    finally:
        pub.close()


def test_the_ipv6_wildcard_serves_both_families_and_the_url_brackets_an_ipv6_address(ipv6_loopback, capsys):
    snap = book().snapshot()
    for host, reached, refused in (("::", ("127.0.0.1", "[::1]"), ()), ("::1", ("[::1]",), ("127.0.0.1",)),
                                   ("127.0.0.1", ("127.0.0.1",), ("[::1]",))):
        server = StatusServer(host, 0, "", lambda: snap)
        try:
            port = server.httpd.server_address[1]
            assert server.url == (f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/")
            for client in reached:
                assert json.loads(get(f"http://{client}:{port}/status.json")[1])["progress"]["steps"] == 4
            for client in refused:
                with pytest.raises(urllib.error.URLError, match="refused"):
                    get(f"http://{client}:{port}/status.json")
        finally:
            server.close()
    assert status_view.main(["[::1]:1"]) == 1  # nobody there, but the address is read as one
    assert "cannot read http://[::1]:1/status.json: [Errno 111] Connection refused" in capsys.readouterr().err


def test_a_status_host_that_is_no_address_is_refused_before_the_scheduler_starts(capsys):
    for text in ("1.2.3.999", "[::1]:8080", "head node", "::g"):
        with pytest.raises(SystemExit) as exit_:
            scheduler_parser().parse_args(["--status-host", text])
        assert exit_.value.code == 2
        assert f"omnips-scheduler: error: argument --status-host: {text!r} is not an IP address or host name" \
            in capsys.readouterr().err
    with pytest.raises(OSError, match=r"^scheduler: cannot bind the status server to no-such-host\.invalid:0: "):
        StatusServer("no-such-host.invalid", 0, "", dict)


def test_omnips_status_takes_host_port_with_an_ipv6_address_in_brackets_or_the_pages_url(capsys):
    assert status_view.status_url("[::1]:8080") == "http://[::1]:8080/status.json"
    assert status_view.status_url("http://[::1]:8080/") == "http://[::1]:8080/status.json"
    assert status_view.status_url("head:9100") == "http://head:9100/status.json"
    assert status_view.status_url("https://head/omnips/") == "https://head/omnips/status.json"
    for address in ("::1:8080", "[::1]", "head", "[::1:80", "head:99999"):
        assert status_view.main([address]) == 1
        err = capsys.readouterr().err
        assert err == f"omnips status: {address!r} is not host:port or the page's URL (an IPv6 address goes in " \
            "brackets: [::1]:PORT)\n", err


def test_a_resumed_runs_page_shows_the_events_before_the_resume_and_goes_on_counting(tmp_path):
    from omnips.metrics import RunDir
    run = RunDir(tmp_path / "run")
    for e in events():
        run.event(e.pop("event"), **{k: v for k, v in e.items() if k != "t"})
    run.close()
    run = RunDir(tmp_path / "run", resume=True)
    pub = StatusPublisher(JOB, str(run.path), "127.0.0.1", 0, "")
    try:
        pub.attach(run, resumed=True)
        run.event("resume", step=4, checkpoint="c")
        pub.tick(now=0.0)
        s = pub.snapshot
        assert s["events_total"] == len(list(events())) + 1 and s["progress"]["steps"] == 4
        assert s["events"][-1]["text"] == "resume step 4"
    finally:
        pub.close()
        run.close()


def test_a_status_server_reachable_from_elsewhere_without_a_token_is_warned_about(caplog):
    for host, token, warned in (("0.0.0.0", "", True), ("0.0.0.0", "tok", False), ("127.0.0.1", "", False)):
        caplog.clear()
        pub = StatusPublisher(JOB, "runs/x", host, 0, token)
        pub.close()
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert bool(said) is warned, (host, token, said)
        if warned:
            assert said[0].startswith(f"status server on {pub.url} without --token: anyone who can reach this port")


def test_the_page_fetches_nothing_from_elsewhere():
    page = PAGE.read_text()
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page)
    assert not re.search(r"@import|url\(", page)
    assert 'fetch("status.json"' in page and page.count("fetch(") == 1


def test_omnips_status_prints_a_finished_runs_table_from_its_files(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(JOB))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events()))
    assert status_view.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert [r[:5] for r in rows] == [["0", "a", "cpu", "training", "4"], ["1", "b", "cpu", "training", "4"]]
    assert rows[1][-2:] == ["<-", "straggler"] and "straggler" not in rows[0]
    assert "progress 40.0 %" in out and "plan 1 (window): batches [5, 3]" in out


def test_the_worker_a_stalled_step_waits_for_is_marked_before_the_slowest_until_the_step_goes_on():
    b = book()
    wait = {"event": "wait", "t": 7.0, "change": "waits", "step": 812, "role": "worker", "rank": 0, "host": "a",
            "device": "cpu", "seconds": 4.14}
    b.add(wait)
    s = b.snapshot()
    why = "step 812 waits for worker 0 (a, cpu) for 4.1 s"
    assert s["straggler"] == 1 and s["waits_for"] == {"role": "worker", "rank": 0, "why": why}
    marked = [line.split()[0] for line in status_view.table(s).splitlines() if line.endswith("<- straggler")]
    assert marked == ["0"] and s["events"][-1]["text"] == why
    b.add({**wait, "role": "server", "device": ""})  # a server is no worker row: the slowest stays marked
    marked = [line.split()[0] for line in status_view.table(b.snapshot()).splitlines() if line.endswith("<- straggler")]
    assert marked == ["1"]
    b.add({**wait, "change": "went on", "seconds": 5.0})
    s = b.snapshot()
    assert s["waits_for"] is None and s["events"][-1]["text"] == "step 812 went on after 5.0 s"


def test_omnips_status_says_why_when_the_address_does_not_answer(capsys):
    assert status_view.main(["127.0.0.1:1"]) == 1
    assert "cannot read http://127.0.0.1:1/status.json" in capsys.readouterr().err
