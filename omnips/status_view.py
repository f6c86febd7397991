"""`omnips status ADDRESS|RUN_DIR`: the status page's table in the terminal, live from a
scheduler's status server or from a run directory's files (a finished run, or one whose
scheduler has no status server)."""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from .metrics import read_events
from .status import StatusBook, duration

FETCH_TIMEOUT_S = 10.0


def from_run_dir(path) -> dict:
    """The snapshot of the run in directory `path`, rebuilt from config.json and metrics.jsonl
    by the scheduler's own book. ValueError naming the file when one cannot be read."""
    path = Path(path)
    try:
        job = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path / 'config.json'}: {exc}") from None
    try:
        events = read_events(path)
    except OSError as exc:
        raise ValueError(f"{path / 'metrics.jsonl'}: {exc}") from None
    # Unix times: the file was last written at its last event
    unix_t0 = (path / "metrics.jsonl").stat().st_mtime - events[-1]["t"] if events else None
    book = StatusBook(job, str(path), unix_t0)
    for e in events:
        book.add(e)
    return book.snapshot()


def status_url(address: str) -> str:
    """The /status.json URL of ADDRESS: host:port ([::1]:port for IPv6, as in a URL) or the
    page's URL (its port may be the scheme's); ValueError for anything else."""
    base = address if "://" in address else f"http://{address}"
    try:
        parts = urlsplit(base)
        ok = parts.scheme in ("http", "https") and parts.hostname and (parts.port is not None or "://" in address)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{address!r} is not host:port or the page's URL (an IPv6 address goes in brackets: "
                         "[::1]:PORT)")
    return base.rstrip("/") + "/status.json"


def fetch(address: str, token: str = "") -> dict:
    """The snapshot a status server serves; ValueError saying why when it cannot be had."""
    url = status_url(address)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        hint = ": give the job's --token (or $OMNIPS_TOKEN)" if exc.code == 401 else ""
        raise ValueError(f"{url} answered {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ValueError(f"cannot read {url}: {getattr(exc, 'reason', exc)}") from None


def _cell(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(snap: dict, now_unix: float | None = None) -> str:
    """The snapshot as text: a header, one row per worker (the straggler marked), the
    servers and the plan."""
    j, p = snap["job"], snap["progress"]
    fraction = p["fraction"]
    lines = [f"{j['mode']} job, {j['batching']} batching, {j['num_workers']} workers, {j['num_servers']} servers: "
             f"{snap['state']}",
             f"progress {'-' if fraction is None else f'{100 * fraction:.1f} %'}  epoch {p['epoch']:.2f}/"
             f"{_cell(p['budget_epochs'], 2)}  step {p['steps']}  ETA {duration(p['eta_s'])}  "
             f"test acc {_cell(snap['test_accuracy'], 4)}"]
    if now_unix is not None and p["last_step_unix"] is not None:
        lines[-1] += f"  last step {duration(max(0.0, now_unix - p['last_step_unix']))} ago"
    waits = snap.get("waits_for")
    marked = waits["rank"] if waits and waits.get("role") == "worker" else snap["straggler"]
    head = ("rank", "host", "device", "state", "batch", "compute ms", "step ms", "wait", "stale", "mem bound", "")
    rows = [head] + [(str(w["rank"]), _cell(w["host"]), _cell(w["device"]), w["state"], _cell(w["batch"]),
                      _cell(w["compute_ms"]), _cell(w["step_ms"]),
                      "-" if w["wait_share"] is None else f"{100 * w['wait_share']:.0f}%",
                      _cell(w["staleness"]), _cell(w["mem_bound"]),
                      "<- straggler" if w["rank"] == marked else "") for w in snap["workers"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines.append("")
    lines += ["  ".join(c.rjust(w) if i in (0, 4, 5, 6, 7, 8, 9) else c.ljust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    if snap["servers"]:
        lines.append("")
        lines += [f"server {s['rank']} on {_cell(s.get('host'))}: shard {_cell(s['shard'] and tuple(s['shard']))}, "
                  f"version {_cell(s['version'])}, {s.get('state', '-')}" for s in snap["servers"]]
    plan = snap["plan"]
    if plan:
        changes = ", ".join(f"{k} {v}" for k, v in sorted(snap["plan_changes_by_reason"].items())) or "none"
        lines += ["", f"plan {plan['gen']} ({plan['reason']}): batches {plan['batches']}; changes: {changes}"]
    return "\n".join(lines)


def main(argv) -> int:
    """show a job's status: live from its status server, or from a run directory"""
    p = argparse.ArgumentParser(prog="omnips status", description="The status of a job: live from its scheduler's "
                                "status server (ADDRESS: host:port or its URL) or from a run directory's files.")
    p.add_argument("target", metavar="ADDRESS|RUN_DIR")
    p.add_argument("--token", default=os.environ.get("OMNIPS_TOKEN", ""),
                   help="the job token, if the job has one (default: $OMNIPS_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        if Path(args.target).is_dir():
            snap = from_run_dir(args.target)
        else:
            snap = fetch(args.target, args.token)
    except ValueError as exc:
        print(f"omnips status: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(snap, indent=1) if args.json else table(snap, time.time()))
    return 0
