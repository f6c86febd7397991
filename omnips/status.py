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


def wait_text(e: dict) -> str | None:
    """What a `wait` event says a stalled step waits for; None once the step went on."""
    if e.get("change") != "waits":
        return None
    where = f"{e['host']}, {e['device']}" if e.get("device") else e["host"]
    return f"step {e['step']} waits for {e['role']} {e['rank']} ({where}) for {e['seconds']:.1f} s"


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
    if kind == "wait":
        return wait_text(e) or f"step {e.get('step')} went on after {e.get('seconds', 0):.1f} s"
    if kind == "checkpoint":
        return f"checkpoint {e.get('step')} " + ("complete" if e.get("complete") else f"incomplete: {e.get('error')}")
    if kind in ("diverged", "recovered", "nonfinite", "rewind", "resume", "end", "start"):
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
        self._last: dict[int, dict] = {}  # rank -> its worker's latest step event
        self._latest: dict | None = None  # the latest step event
        self._top_step = -1  # the furthest step number reported
        self._top_epoch = 0.0
        self.test_accuracy: float | None = None
        self.versions: list | None = None  # the servers' versions at the latest evaluation
        self.step_time = _Series()  # (t, seconds of the step: compute + network + wait)
        self.accuracy = _Series()  # (t, epoch, accuracy)
        self._progress: deque = deque()  # (t, fraction) over ETA_WINDOW_S
        self.events: deque = deque(maxlen=EVENTS_KEPT)
        self._step_events = self._other_events = 0
        # whom a stalled step waits for, {"role", "rank", "why"}, from the scheduler's `wait` events;
        # the page and `omnips status` mark that worker before the straggler
        self.waits_for: dict | None = None
        self._t = 0.0  # time of the latest event other than a step

    # -- events in ----------------------------------------------------------------
    def add(self, e: dict) -> None:
        """An event as metrics.jsonl holds it (the book watches the run directory)."""
        if e["event"] == "step":  # one per worker report: the hot path, two assignments and a test
            self._last[e["worker"]] = self._latest = e
            self._step_events += 1
            if e["step"] > self._top_step:  # once per step (BSP: its workers' times are alike)
                self._new_step(e)
            return
        self._other_events += 1
        self._t = e["t"]
        kind = e["event"]
        handler = getattr(self, "_on_" + kind, None)
        if handler is not None:
            handler(e)
        line = _describe(e)
        if line is not None:
            self.events.append({"t": e.get("t"), "event": kind, "text": line})


    def close(self) -> None:
        """Nothing to release: the book is memory only."""

    def _new_step(self, e: dict) -> None:
        t = e["t"]
        self._top_step = e["step"]
        self.step_time.add((t, _step_s(e)))
        budget = self.start.get("budget_epochs")
        if budget:
            self._progress.append((t, min(1.0, e["epoch"] / budget)))
            while t - self._progress[0][0] > ETA_WINDOW_S:
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
            self._last.pop(e["rank"], None)  # a new worker in a rank starts a new row

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

    def _on_wait(self, e: dict) -> None:
        why = wait_text(e)
        self.waits_for = None if why is None else {"role": e["role"], "rank": e["rank"], "why": why}

    def _on_end(self, e: dict) -> None:
        self.state = e.get("status", "ended")
        for w in self.workers.values():
            if w.get("state") != "lost":
                w["state"] = "finished" if self.state == "completed" else "stopped"

    # -- snapshot out -------------------------------------------------------------
    @property
    def steps(self) -> int:
        """BSP: the furthest global step; ASP/SSP: updates reported (replays after a rewind count again)."""
        return self._top_step + 1 if self.job.get("mode") == "bsp" else self._step_events

    @property
    def events_total(self) -> int:
        return self._step_events + self._other_events

    @property
    def t(self) -> float:
        """The time of the latest event."""
        return max(self._t, self.last_step_t or 0.0)

    @property
    def samples(self) -> int:
        """Training samples consumed: the furthest epoch seen over the training set (as the scheduler
        counts them; a rewind takes the epoch back, not the samples consumed)."""
        self._top_epoch = max(self._top_epoch, self.epoch)
        return round(self._top_epoch * self.start.get("train_size", 0))

    @property
    def epoch(self) -> float:
        return self._latest["epoch"] if self._latest else 0.0

    @property
    def last_step_t(self) -> float | None:
        return self._latest["t"] if self._latest else None

    def _worker_row(self, w: dict) -> dict:
        rank, e = w["rank"], self._last.get(w["rank"])
        state = w.get("state", "joined")
        row = {"rank": rank, "host": w.get("host"), "device": w.get("device"),
               "state": "training" if state == "joined" and e is not None else state,
               "batch": None, "compute_ms": None, "step_ms": None, "wait_share": None, "staleness": None,
               "loss": None, "mem_free_bytes": None, "step": None,
               "mem_bound": self.max_batch[rank] if self.max_batch and rank < len(self.max_batch) else None}
        if e is not None:
            total = _step_s(e)
            row.update(batch=e["batch"], compute_ms=1000 * e["compute_s"], step_ms=1000 * total,
                       wait_share=(e["network_s"] + e["wait_s"]) / total if total > 0 else None,
                       staleness=e.get("staleness", 0), loss=e.get("loss"), mem_free_bytes=e.get("mem_free") or None,
                       step=e["step"])
            row["mem_bound"] = e.get("mem_batch") or row["mem_bound"]
        return row

    def snapshot(self) -> dict:
        workers = [self._worker_row(self.workers.get(r, {"rank": r})) for r in sorted({*self.workers, *self._last})]
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
        eta = None if ended or fraction is None else eta_s([*self._progress, (self.last_step_t, fraction)])
        return {
            "job": {k: self.job.get(k) for k in ("mode", "batching", "num_workers", "num_servers", "global_batch",
                                                  "model", "dataset", "optimizer", "lr")},
            "run_dir": self.run_dir,
            "state": self.state,
            "progress": {"steps": self.steps, "samples": self.samples, "epoch": self.epoch,
                         "budget_epochs": budget, "fraction": fraction,
                         "eta_s": eta,
                         "last_step_t": self.last_step_t, "last_step_unix": unix(self.last_step_t)},
            "plan": self.plan,
            "plan_changes": list(self.plan_changes),
            "plan_changes_by_reason": dict(self.changes_by_reason),
            "workers": workers,
            "straggler": straggler,  # the slowest worker by compute time
            "waits_for": self.waits_for,
            "servers": servers,
            "test_accuracy": self.test_accuracy,
            "series": {"step_time": list(self.step_time.points), "accuracy": list(self.accuracy.points)},
            "events": list(self.events),
            "events_total": self.events_total,
            "t": self.t,
            "unix": unix(self.t),
        }


def _step_s(e: dict) -> float:
    """A step event's whole step: compute, overhead (the network among it) and the servers' hold. A
    run written before steps carried overhead_s recorded its network time alone."""
    return e["compute_s"] + e.get("overhead_s", e["network_s"]) + e["wait_s"]
