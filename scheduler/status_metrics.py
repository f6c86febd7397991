"""A status snapshot (omnips.status) as Prometheus metrics: pure, snapshot in, families out.

A private CollectorRegistry per status server, never the global one: a process that
runs two schedulers (the tests do) would otherwise mix their jobs' numbers.
"""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

WORKER_GAUGES = (  # name, row key, scale, help
    ("omnips_worker_batch", "batch", 1, "samples in the worker's latest step"),
    ("omnips_worker_compute_seconds", "compute_ms", 1e-3, "compute phase of the worker's latest step"),
    ("omnips_worker_wait_ratio", "wait_share", 1, "share of the worker's latest step spent waiting "
                                                  "(network and barrier)"),
    ("omnips_worker_staleness", "staleness", 1, "server versions between the worker's pull and its update "
                                                "(asp/ssp; 0 in bsp)"),
    ("omnips_worker_free_memory_bytes", "mem_free_bytes", 1, "memory free on the worker's device, as it last "
                                                             "measured"),
)


def families(snap: dict) -> list:
    """The metric families of `snap`; a value not known yet is left out, never shown as 0."""
    p = snap["progress"]
    out = [
        CounterMetricFamily("omnips_steps", "BSP: global steps taken; asp/ssp: updates reported",
                            value=p["steps"]),
        CounterMetricFamily("omnips_samples", "training samples consumed", value=p["samples"]),
        CounterMetricFamily("omnips_events", "events written to the run's metrics.jsonl", value=snap["events_total"]),
        GaugeMetricFamily("omnips_epoch", "passes over the training set so far", value=p["epoch"]),
    ]
    changes = CounterMetricFamily("omnips_plan_changes", "new batch plans, by reason", labels=["reason"])
    for reason, n in sorted(snap["plan_changes_by_reason"].items()):
        changes.add_metric([str(reason)], n)
    out.append(changes)
    for name, value, text in (
            ("omnips_last_step_timestamp_seconds", p["last_step_unix"], "Unix time of the latest step report"),
            ("omnips_progress_ratio", p["fraction"], "share of the job's sample budget done"),
            ("omnips_eta_seconds", p["eta_s"], "seconds left at the rate of the last 30 s"),
            ("omnips_test_accuracy", snap["test_accuracy"], "the latest evaluation's test accuracy")):
        if value is not None:
            out.append(GaugeMetricFamily(name, text, value=value))
    for name, key, scale, text in WORKER_GAUGES:
        g = GaugeMetricFamily(name, text, labels=["rank"])
        for w in snap["workers"]:
            if w[key] is not None and w["state"] != "lost":
                g.add_metric([str(w["rank"])], w[key] * scale)
        out.append(g)
    return out


class _Collector:
    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        return families(self.snapshot())


def registry(snapshot) -> CollectorRegistry:
    """A private registry whose every scrape reads `snapshot()` (the newest published)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(snapshot))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
