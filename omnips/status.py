"""A job's status, folded from its events: the one object behind the scheduler's status
server (live, fed each event as it is written) and `omnips status RUN_DIR` (fed a
finished run's metrics.jsonl). Pure: events in, a plain snapshot dict out; no clock,
no I/O. The snapshot is what /status.json serves and what /metrics is made from.
"""

from collections import Counter, deque

from .sharding import shard_ranges

SERIES_MAX = 600  # points kept per chart; past it every other one is dropped (the early ones thin out)
PLAN_CHANGES_KEPT = 50
EVENTS_KEPT = 20
ETA_WINDOW_S = 30.0  # the progress rate behind the ETA is measured over this much of the latest event time


def eta_s(points) -> float | None:
    """Seconds until the fraction done reaches 1, at the rate of `points` ((t, fraction)
    pairs, oldest first); None while that rate is not known or not positive."""
    if len(points) < 2:
        return None
    (t0, f0), (t1, f1) = points[0], points[-1]
    if t1 <= t0 or f1 <= f0:
        return None
    return max(0.0, (1.0 - f1) * (t1 - t0) / (f1 - f0))


def duration(s: float | None) -> str:
    """Seconds as a person reads them: 45s, 3m05s, 2h10m; '-' for None."""
    if s is None:
        return "-"
    s = round(s)
    h, m = divmod(s, 3600)
    m, sec = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def _describe(e: dict) -> str | None:
    """One line for the recent-events list; None for events it leaves out (steps, probes)."""
    kind = e["event"]
    if kind == "membership":
        return f"{e.get('role')} {e.get('rank')} {e.get('change')} on {e.get('host')}" + \
            (f": {e['reason']}" if e.get("reason") else "")
    if kind == "assign":
        return f"plan {e.get('gen')} ({e.get('reason')}): batches {e.get('batches')}"
    if kind == "eval":
        return f"epoch {e.get('epoch', 0):.2f}: test accuracy {e.get('test_accuracy', 0):.4f}"
    if kind == "checkpoint":
        return f"checkpoint {e.get('step')} " + ("complete" if e.get("complete") else f"incomplete: {e.get('error')}")
    if kind in ("diverged", "nonfinite", "rewind", "resume", "end", "start"):
        rest = {k: v for k, v in e.items() if k in ("reason", "worker", "step", "status", "steps_lost")}
        return kind + (" " + ", ".join(f"{k} {v}" for k, v in rest.items()) if rest else "")
    return None


class _Series:
    """A chart's points, thinned to at most SERIES_MAX."""

    def __init__(self):
        self.points: list = []

    def add(self, point) -> None:
        self.points.append(point)
        if len(self.points) > SERIES_MAX:
            del self.points[1::2]


class StatusBook:
    def __init__(self, job: dict, run_dir: str = "", unix_t0: float | None = None):
        """`job`: the job spec as config.json holds it; `unix_t0`: the Unix time at event
        time t = 0 (None: unknown, no wall-clock times in the snapshot)."""
        self.job, self.run_dir, self.unix_t0 = job, run_dir, unix_t0
        self.state = "forming"
        self.start: dict = {}
        self.workers: dict[int, dict] = {}  # rank -> its row's facts
        self.servers: dict[int, dict] = {}
        self.plan: dict | None = None
        self.plan_changes: deque = deque(maxlen=PLAN_CHANGES_KEPT)
        self.changes_by_reason: Counter = Counter()
        self.max_batch: list | None = None  # the controller's bounds, from its latest plan
        self.steps = 0  # BSP: the furthest global step; ASP/SSP: updates (the furthest step per worker, summed)
        self._worker_steps: dict[int, int] = {}
        self.samples = 0
        self.epoch = 0.0
        self.last_step_t: float | None = None
        self.test_accuracy: float | None = None
        self.versions: list | None = None  # the servers' versions at the latest evaluation
        self.step_time = _Series()  # (t, seconds of the step: compute + network + wait)
        self.accuracy = _Series()  # (t, epoch, accuracy)
        self._last_step_no = -1
        self._progress: deque = deque()  # (t, fraction) over ETA_WINDOW_S
        self.events: deque = deque(maxlen=EVENTS_KEPT)
        self.events_total = 0
        self.t = 0.0  # time of the latest event

    # -- events in ----------------------------------------------------------------
    def on_event(self, e: dict) -> None:
        self.events_total += 1
        self.t = e.get("t", self.t)
        kind = e["event"]
        if kind == "step":
            self._step(e)  # first and alone: one event per worker per step
            return
        handler = getattr(self, "_on_" + kind, None)
        if handler is not None:
            handler(e)
        line = _describe(e)
        if line is not None:
            self.events.append({"t": e.get("t"), "event": kind, "text": line})

    def _step(self, e: dict) -> None:
        rank, step = e["worker"], e["step"]
        w = self.workers.setdefault(rank, {"rank": rank})
        w.update(state="training", batch=e["batch"], compute_s=e["compute_s"], network_s=e["network_s"],
                 wait_s=e["wait_s"], staleness=e.get("staleness", 0), loss=e.get("loss"),
                 mem_free=e.get("mem_free", 0), mem_batch=e.get("mem_batch", 0), step=step)
        self._worker_steps[rank] = max(self._worker_steps.get(rank, 0), step + 1)
        self.steps = max(self.steps, max(self._worker_steps.values()) if self.job.get("mode") == "bsp"
                         else sum(self._worker_steps.values()))
        self.epoch = e["epoch"]
        train = self.start.get("train_size")
        if train:
            self.samples = max(self.samples, round(self.epoch * train))
        self.last_step_t = e["t"]
        if step > self._last_step_no:  # one point per step (BSP: its workers' times are alike)
            self._last_step_no = step
            self.step_time.add((e["t"], e["compute_s"] + e["network_s"] + e["wait_s"]))
        budget = self.start.get("budget_epochs")
        if budget:
            self._progress.append((e["t"], min(1.0, self.epoch / budget)))
            while self._progress[-1][0] - self._progress[0][0] > ETA_WINDOW_S:
                self._progress.popleft()

    def _on_start(self, e: dict) -> None:
        self.start = e
        self.state = "forming"

    def _on_membership(self, e: dict) -> None:
        rows = self.workers if e["role"] == "worker" else self.servers
        row = rows.setdefault(e["rank"], {"rank": e["rank"]})
        lost = e["change"] == "lost"
        row.update(host=e.get("host"), device=e.get("device"), state="lost" if lost else "joined")
        if not lost and e["role"] == "worker":
            for key in ("batch", "compute_s", "network_s", "wait_s", "staleness", "mem_free", "mem_batch"):
                row.pop(key, None)  # a new worker in a rank starts a new row

    def _on_assign(self, e: dict) -> None:
        self.plan = {k: e.get(k) for k in ("gen", "batches", "reason", "step", "predicted_step_s", "rule")}
        if self.state == "forming":
            self.state = "running"
        if e.get("max_batch") is not None:
            self.max_batch = e["max_batch"]
        if e.get("reason") != "start":  # the first plan is no change
            self.changes_by_reason[e.get("reason")] += 1
        self.plan_changes.append({"t": e.get("t"), "gen": e.get("gen"), "reason": e.get("reason"),
                                  "step": e.get("step"), "batches": e.get("batches")})

    def _on_eval(self, e: dict) -> None:
        self.test_accuracy = e.get("test_accuracy")
        self.versions = e.get("versions")
        self.accuracy.add((e["t"], e.get("epoch"), self.test_accuracy))

    def _on_end(self, e: dict) -> None:
        self.state = e.get("status", "ended")
        for w in self.workers.values():
            if w.get("state") != "lost":
                w["state"] = "finished" if self.state == "completed" else "stopped"

    # -- snapshot out -------------------------------------------------------------
    def _worker_row(self, w: dict) -> dict:
        total = w.get("compute_s", 0) + w.get("network_s", 0) + w.get("wait_s", 0)
        rank = w["rank"]
        bound = w.get("mem_batch") or (self.max_batch[rank] if self.max_batch and rank < len(self.max_batch)
                                       else None)
        return {"rank": rank, "host": w.get("host"), "device": w.get("device"), "state": w.get("state", "joined"),
                "batch": w.get("batch"),
                "compute_ms": 1000 * w["compute_s"] if "compute_s" in w else None,
                "step_ms": 1000 * total if "compute_s" in w else None,
                "wait_share": (w["network_s"] + w["wait_s"]) / total if "compute_s" in w and total > 0 else None,
                "staleness": w.get("staleness"), "loss": w.get("loss"),
                "mem_free_bytes": w.get("mem_free") or None, "mem_bound": bound, "step": w.get("step")}

    def snapshot(self) -> dict:
        workers = [self._worker_row(self.workers[r]) for r in sorted(self.workers)]
        timed = [w for w in workers if w["state"] != "lost" and w["compute_ms"] is not None]
        straggler = max(timed, key=lambda w: w["compute_ms"])["rank"] if len(timed) > 1 else None
        budget = self.start.get("budget_epochs")
        fraction = min(1.0, self.epoch / budget) if budget else None
        if self.state == "completed":
            fraction = 1.0
        unix = (lambda t: None if t is None or self.unix_t0 is None else self.unix_t0 + t)
        num_params = self.start.get("num_params")
        ranges = shard_ranges(num_params, self.job.get("num_servers", 1)) if num_params is not None else []
        servers = []
        for s in sorted(self.servers):
            version = self.versions[s] if self.versions and s < len(self.versions) else None
            if self.job.get("mode") == "bsp":  # every shard applies each global step
                version = max(version or 0, self.steps)
            servers.append({**self.servers[s], "shard": list(ranges[s]) if s < len(ranges) else None,
                            "version": version})
        ended = self.state not in ("forming", "running")
        return {
            "job": {k: self.job.get(k) for k in ("mode", "batching", "num_workers", "num_servers", "global_batch",
                                                  "model", "dataset", "optimizer", "lr")},
            "run_dir": self.run_dir,
            "state": self.state,
            "progress": {"steps": self.steps, "samples": self.samples, "epoch": self.epoch,
                         "budget_epochs": budget, "fraction": fraction,
                         "eta_s": None if ended else eta_s(self._progress),
                         "last_step_t": self.last_step_t, "last_step_unix": unix(self.last_step_t)},
            "plan": self.plan,
            "plan_changes": list(self.plan_changes),
            "plan_changes_by_reason": dict(self.changes_by_reason),
            "workers": workers,
            "straggler": straggler,  # the slowest worker by compute time
            "waits_for": None,  # whom the job waits for, from the scheduler's own account (not filled yet)
            "servers": servers,
            "test_accuracy": self.test_accuracy,
            "series": {"step_time": list(self.step_time.points), "accuracy": list(self.accuracy.points)},
            "events": list(self.events),
            "events_total": self.events_total,
            "t": self.t,
            "unix": unix(self.t),
        }

