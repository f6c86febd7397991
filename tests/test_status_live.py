"""The status server during a real job (scheduler, server and workers as processes): /metrics
scraped until the scheduler exits, parsed with prometheus_client's parser, agrees with the
run's metrics.jsonl and its counters never go back; `omnips status` reads the same table
live and from the files; the page, in headless Chromium, shows every worker and marks the
straggler (skipped, saying so, where no Chromium can be had). A scheduler alone serves its
status over IPv6 loopback."""

import json
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnips import headless, status_view
from omnips.launch import WorkerSpec, read_announcements
from omnips.metrics import read_events
from helpers import JOB_TIMEOUT_S, WAIT_FACTOR, finish, start_cluster

pytestmark = pytest.mark.cluster  # a real job, and a browser

COUNTERS = ("omnips_steps_total", "omnips_samples_total", "omnips_events_total", "omnips_plan_changes_total")


def scrape(url: str) -> dict | None:
    """{(sample name, labels): value} of one /metrics scrape; None once nobody answers."""
    try:
        with urllib.request.urlopen(url + "metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:  # (URLError, a refused or reset connection)
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def expected(events: list[dict]) -> dict:
    """What a scrape taken after `events` (metrics.jsonl's first lines) must say, worked out
    here apart from the scheduler's own book."""
    steps = [e for e in events if e["event"] == "step"]  # (none before the start event)
    want = {("omnips_events_total", ()): len(events)}
    if steps:
        want[("omnips_steps_total", ())] = max(e["step"] for e in steps) + 1  # BSP: the furthest global step
        train = next(e for e in events if e["event"] == "start")["train_size"]
        want[("omnips_samples_total", ())] = round(steps[-1]["epoch"] * train)
        want[("omnips_epoch", ())] = steps[-1]["epoch"]
    for e in steps:  # each worker's latest step
        label = (("rank", str(e["worker"])),)
        total = e["compute_s"] + e["overhead_s"] + e["wait_s"]
        want[("omnips_worker_batch", label)] = e["batch"]
        want[("omnips_worker_compute_seconds", label)] = e["compute_s"]
        want[("omnips_worker_wait_ratio", label)] = (e["network_s"] + e["wait_s"]) / total
        want[("omnips_worker_staleness", label)] = e["staleness"]
    reasons = Counter(e["reason"] for e in events if e["event"] == "assign" and e["reason"] != "start")
    for reason, n in reasons.items():
        want[("omnips_plan_changes_total", (("reason", reason),))] = n
    evals = [e for e in events if e["event"] == "eval"]
    if evals:
        want[("omnips_test_accuracy", ())] = evals[-1]["test_accuracy"]
    return want


def page_checked(url: str, tmp_path) -> bool:
    """The page's DOM after its script ran: a row per worker, the straggler (rank 2, four
    times slower) marked; a screenshot kept beside. False where no Chromium can be had."""
    browser = headless.find_chromium()
    if browser is None:
        warnings.warn("no Chromium (apt-get install chromium): the status page was not loaded in a browser")
        return False
    dom = headless.dump_dom(browser, url)
    rows = [r for r in dom.split("<tr ")[1:] if r.startswith('class="worker')]
    assert [r.split('data-rank="')[1].split('"')[0] for r in rows] == ["0", "1", "2"], dom[-3000:]
    marked = [r.split('data-rank="')[1].split('"')[0] for r in rows if 'data-straggler="1"' in r]
    assert marked == ["2"] and "straggler</span>" in rows[2] and 'data-loaded="1"' in dom
    assert headless.screenshot(browser, url, tmp_path / "status.png").stat().st_size > 10_000
    return True


def test_metrics_scraped_during_a_job_agree_with_its_events_and_the_page_marks_the_straggler(tmp_path):
    workers = [WorkerSpec(ms_per_step=25, slowdown=s) for s in ("1", "1", "4")]
    cluster = start_cluster(tmp_path / "run", ["--batching", "uniform", "--global-batch", "24", "--max-steps",
                                               "2000", "--heartbeat", "0.5", "--dead-after", "20"], workers)
    url = cluster.status_url
    assert url and url.startswith("http://127.0.0.1:"), url
    scrapes, browser, live_table = [], None, None
    deadline = time.monotonic() + 2 * JOB_TIMEOUT_S  # the job, and Chromium twice on a loaded host
    stopped = False
    while time.monotonic() < deadline:
        got = scrape(url)
        if got is None:
            assert stopped or cluster.poll() is not None, "the status server stopped answering while the job ran"
            break
        scrapes.append(got)
        batches = [k for k in got if k[0] == "omnips_worker_batch"]
        if not stopped and len(batches) == 3 and got.get(("omnips_steps_total", ()), 0) >= 5:
            browser = page_checked(url, tmp_path)
            assert status_view.main([url]) == 0
            live_table = True
            cluster.procs["scheduler"].send_signal(signal.SIGTERM)  # enough seen: stop the job
            stopped = True
        time.sleep(0.2)  # scrape interval
    else:
        pytest.fail(f"the job did not end within {2 * JOB_TIMEOUT_S} s")
    run = finish(cluster, expect_ok=False)
    assert live_table and run.summary["status"] == "preempted", run.logs()  # SIGTERM: a preemption
    events = read_events(run.dir)
    assert len(scrapes) >= 3
    for before, after in zip(scrapes, scrapes[1:]):  # counters never go back
        for key, value in before.items():
            if key[0] in COUNTERS:
                assert after.get(key, 0) >= value, (key, value, after.get(key))
    for got in scrapes:  # every scrape is metrics.jsonl up to the events it counts
        want = expected(events[:int(got[("omnips_events_total", ())])])
        assert {k: got.get(k) for k in want} == pytest.approx(want), (want, got)
    assert any(k[0] == "omnips_last_step_timestamp_seconds" for k in scrapes[-1])
    last = scrapes[-1][("omnips_last_step_timestamp_seconds", ())]
    assert last <= time.time()
    files = status_view.from_run_dir(run.dir)  # the finished run, from its files
    assert files["progress"]["steps"] == run.summary["steps"] and files["straggler"] == 2
    assert [w["batch"] for w in files["workers"]] == [8, 8, 8]
    if not browser:
        pytest.skip("no Chromium: the page was not loaded in a browser (apt-get install chromium)")


@pytest.mark.core
def test_a_scheduler_serves_its_status_over_ipv6_loopback(tmp_path, ipv6_loopback, capsys):
    proc = subprocess.Popen([sys.executable, "-m", "omnips.scheduler", "--status-host", "::1", "--num-workers", "2",
                             "--run-dir", str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        endpoint, url = read_announcements(proc.stdout, 60 * WAIT_FACTOR)
        assert endpoint and url and url.startswith("http://[::1]:"), (endpoint, url, proc.poll())
        with urllib.request.urlopen(url + "status.json", timeout=30) as r:
            snap = json.loads(r.read())
        assert snap["state"] == "forming" and snap["job"]["num_workers"] == 2, snap
        assert status_view.main([url.removeprefix("http://").rstrip("/")]) == 0  # omnips status [::1]:PORT
        assert "2 workers, 1 servers: forming" in capsys.readouterr().out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60 * WAIT_FACTOR)
        finally:
            proc.kill()  # (a no-op once it has exited)
