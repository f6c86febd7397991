#!/usr/bin/env python
"""How fast a dead worker is detected, what its death costs a BSP job, what a lost
server costs, and what a worker lost at the end of an ASP job and a full disk cost.

For each --dead-after value D (heartbeats every D/5 s), one invocation runs BSP on
digits (mlp, 3 workers on virtual devices of 20 ms per step, one server) and SIGKILLs
worker 2 once 30 steps are done. From metrics.jsonl (event times are seconds after
the scheduler's `clock_t0` on the system's monotonic clock, which this process
shares) it takes:

* detection: kill -> the scheduler's `membership lost` event;
* resume: the loss -> the first step the survivors complete after it (BSP waits for
  the dead worker until it is declared gone);
* samples missing: the global batch minus what the reported steps after the dead
  worker's last report trained on (its slices of those steps).

Detection over D is the figure of merit: a silence has to last D, and the scheduler
looks at least every 100 ms, so it should sit a little above 1.

Then, for each --checkpoint-every K, a BSP job on 2 servers has server 1 SIGKILLed
after 37 steps and started again once the scheduler logs the loss; from the `rewind`
event: the steps lost (reached minus the checkpoint's step: at most K, or 2K if the
newest checkpoint was still being written) and the time from the kill to the rewind
(D = 2 s of detection, the new server's start-up and its restore).

Then (--parts unreplaced) server 1 is SIGKILLed and nobody starts another: from the
kill to the scheduler's `membership lost` event (detection) and to its `end` event (the
job fails with that reason once the workers give up, after their --server-timeout), the
steps lost (reached minus the newest complete checkpoint) and how often the log said what
the job waits for. And (--parts stalls) a worker, then a server, is stopped (SIGSTOP) for
STOP_S: from the stop to the scheduler's `wait` event naming it, in seconds and heartbeat
intervals, and how long the step was held. And (--parts scheduler) the scheduler is
SIGKILLed: from the kill to the workers' hold, and the checkpoints begun that never complete.

And (--parts asplate) an ASP job (3 workers, 2 servers, --dead-after 2 s) has worker 2
SIGKILLed once ASP_KILL_AT of its sample budget is done, so that the survivors may finish
before it is found silent: from the kill to its `membership lost` event and to the `end`
event, the status, final_test_accuracy and model.pt (such a job used to fail after 120 s
without a model). And (--parts fulldisk) a BSP job's run directory is on a small tmpfs,
filled once a checkpoint is complete and freed FULL_S later: from the disk being full to
the first line saying so in the scheduler's log (metrics.jsonl) and server 0's (a
checkpoint not written), summary.json's status and events_lost, the checkpoints left
incomplete and the `*.tmp` files left (none expected). It needs mount (root).

    python benchmarks/failures.py [--dead-after 1,2,5] [--checkpoint-every 5,10,20] [--repeats 2]
                                  [--parts dead,restart,unreplaced,scheduler,stalls,asplate,fulldisk]

Prints the tables and writes them to benchmarks/results/failures.md; a part not run
keeps its section of that file as it was.
"""

import argparse
import contextlib
import datetime
import errno
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from report import machine_lines, publish, runs_dir  # noqa: E402

from omnips.launch import LocalCluster, WorkerSpec  # noqa: E402
from omnips.metrics import read_events  # noqa: E402

GLOBAL_BATCH = 48
KILL_AFTER_STEPS = 30
JOB_TIMEOUT_S = 180
STOP_S = 5.0
SCHEDULER_DEAD_AFTER_S = 30
WORKER_SERVER_TIMEOUT_S = 10
ASP_EPOCHS = 4
ASP_KILL_AT = 0.88  # of the sample budget
FULL_DISK_SIZE = "8m"
FULL_S = 5.0


def _events(run_dir: Path) -> list[dict]:
    return read_events(run_dir) if (run_dir / "metrics.jsonl").exists() else []


def _wait_until(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)  # polling a file the scheduler writes; bounded by the deadline
    raise SystemExit(f"timed out waiting for {what}")


def run_one(root: Path, dead_after: float, k: int) -> dict:
    run_dir = root / f"d{dead_after:g}-{k}"
    job = ["--mode", "bsp", "--max-steps", "300", "--global-batch", str(GLOBAL_BATCH), "--seed", str(k),
           "--heartbeat", f"{dead_after / 5:g}", "--dead-after", f"{dead_after:g}"]
    cluster = LocalCluster(run_dir, job, 1, [WorkerSpec(ms_per_step=20.0)] * 3)
    with cluster:
        cluster.start()
        _wait_until(lambda: sum(e["event"] == "step" for e in _events(run_dir)) >= 3 * KILL_AFTER_STEPS,
                    60, "the first steps")
        killed_at = time.monotonic()
        cluster.procs["worker2"].send_signal(signal.SIGKILL)
        code = cluster.wait(JOB_TIMEOUT_S)
    if code != 0:
        raise SystemExit(f"D={dead_after}: the job failed (run dir {run_dir}): {cluster.tail('scheduler')}")
    events = read_events(run_dir)
    t0 = next(e["clock_t0"] for e in events if e["event"] == "start")
    lost = next(e for e in events if e["event"] == "membership" and e["change"] == "lost")
    after = [e for e in events if e["event"] == "step" and e["t"] > lost["t"] and e["worker"] != 2]
    switch = next(e for e in events if e["event"] == "assign" and e["reason"] == "lost")
    steps = {}
    for e in events:
        if e["event"] == "step":
            steps.setdefault(e["step"], 0)
            steps[e["step"]] += e["batch"]
    short = sum(GLOBAL_BATCH - b for s, b in steps.items() if s > lost["last_step"])
    return {"detect_s": t0 + lost["t"] - killed_at, "resume_s": min(e["t"] for e in after) - lost["t"],
            "lost_samples": short, "switch_step": switch["step"], "last_step": lost["last_step"]}


def restart_one(root: Path, every: int, k: int) -> dict:
    run_dir = root / f"k{every}-{k}"
    job = ["--mode", "bsp", "--max-steps", "200", "--global-batch", str(GLOBAL_BATCH), "--seed", str(k),
           "--heartbeat", "0.4", "--dead-after", "2", "--checkpoint-every", str(every)]
    cluster = LocalCluster(run_dir, job, 2, [WorkerSpec(ms_per_step=20.0)] * 2)
    with cluster:
        cluster.start()
        _wait_until(lambda: sum(e["event"] == "step" for e in _events(run_dir)) >= 2 * 37, 60, "the first steps")
        killed_at = time.monotonic()
        cluster.procs["server1"].send_signal(signal.SIGKILL)
        _wait_until(lambda: any(e["event"] == "membership" and e["change"] == "lost" for e in _events(run_dir)),
                    60, "the loss")
        cluster.start_server("server1-again")
        code = cluster.wait(JOB_TIMEOUT_S)
    if code != 0:
        raise SystemExit(f"K={every}: the job failed (run dir {run_dir}): {cluster.tail('scheduler')}")
    events = read_events(run_dir)
    t0 = next(e["clock_t0"] for e in events if e["event"] == "start")
    rewind = next(e for e in events if e["event"] == "rewind")
    return {"lost": rewind["steps_lost"], "recover_s": t0 + rewind["t"] - killed_at, "step": rewind["step"]}


def unreplaced_one(root: Path, k: int) -> dict:
    run_dir = root / f"unreplaced-{k}"
    job = ["--mode", "bsp", "--max-steps", "100000", "--global-batch", str(GLOBAL_BATCH), "--seed", str(k),
           "--heartbeat", "0.4", "--dead-after", "2", "--checkpoint-every", "10"]
    workers = [WorkerSpec(ms_per_step=20.0, extra=("--server-timeout", str(WORKER_SERVER_TIMEOUT_S)))] * 2
    cluster = LocalCluster(run_dir, job, 2, workers)
    with cluster:
        cluster.start()
        _wait_until(lambda: sum(e["event"] == "step" for e in _events(run_dir)) >= 2 * 37, 180, "the first steps")
        killed_at = time.monotonic()
        cluster.procs["server1"].send_signal(signal.SIGKILL)
        code = cluster.wait(JOB_TIMEOUT_S)
    events = read_events(run_dir)
    t0 = next(e["clock_t0"] for e in events if e["event"] == "start")
    lost = next(e for e in events if e["event"] == "membership" and e["change"] == "lost")
    end = next(e for e in events if e["event"] == "end")
    if code != 1 or " was lost " not in end["status"]:
        raise SystemExit(f"unreplaced: not the expected failure (run dir {run_dir}): {end['status']}")
    reached = max(e["step"] for e in events if e["event"] == "step")
    newest = max(e["step"] for e in events if e["event"] == "checkpoint" and e["complete"])
    said = (run_dir / "logs" / "scheduler.log").read_text().count("the job waits for a server to take")
    return {"detect_s": t0 + lost["t"] - killed_at, "end_s": t0 + end["t"] - killed_at,
            "lost": reached + 1 - newest, "said": said}


def stall_one(root: Path, who: str, heartbeat_s: float, k: int) -> dict:
    """`who`: "worker2" or "server1", stopped for STOP_S after 40 steps of a BSP job."""
    run_dir = root / f"stall-{who}-{heartbeat_s:g}-{k}"
    job = ["--mode", "bsp", "--max-steps", "150", "--global-batch", str(GLOBAL_BATCH), "--seed", str(k),
           "--heartbeat", f"{heartbeat_s:g}", "--dead-after", "30"]
    cluster = LocalCluster(run_dir, job, 2, [WorkerSpec(ms_per_step=20.0)] * 3)
    with cluster:
        cluster.start()
        _wait_until(lambda: sum(e["event"] == "step" for e in _events(run_dir)) >= 3 * 40, 180, "the first steps")
        proc = cluster.procs[who]
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(STOP_S)  # the stall itself
        finally:
            proc.send_signal(signal.SIGCONT)
        code = cluster.wait(JOB_TIMEOUT_S)
    if code != 0:
        raise SystemExit(f"stall {who}: the job failed (run dir {run_dir}): {cluster.tail('scheduler')}")
    events = read_events(run_dir)
    t0 = next(e["clock_t0"] for e in events if e["event"] == "start")
    pid = proc.pid
    member = next(e for e in events if e["event"] == "membership" and e["pid"] == pid)
    named = next(e for e in events if e["event"] == "wait" and e["change"] == "waits" and e["t"] + t0 > stopped_at
                 and (e["role"], e["rank"]) == (member["role"], member["rank"]))
    times = sorted(e["t"] for e in events if e["event"] == "step")
    return {"named_s": t0 + named["t"] - stopped_at, "held_s": max(b - a for a, b in zip(times, times[1:]))}


def scheduler_one(root: Path, k: int) -> dict:
    """The scheduler SIGKILLed in a BSP job that asks a checkpoint every 2 steps: how long the
    workers trained on (kill to a worker's hold, from its log) and the checkpoints the server
    began that no manifest can complete."""
    run_dir = root / f"scheduler-{k}"
    job = ["--mode", "bsp", "--max-steps", "100000", "--global-batch", str(GLOBAL_BATCH), "--seed", str(k),
           "--heartbeat", "1", "--dead-after", str(SCHEDULER_DEAD_AFTER_S), "--checkpoint-every", "2"]
    cluster = LocalCluster(run_dir, job, 1, [WorkerSpec(ms_per_step=100.0)] * 2)
    with cluster:
        cluster.start()
        _wait_until(lambda: sum(e["event"] == "step" for e in _events(run_dir)) >= 2 * 40, 180, "the first steps")
        killed_at = time.time()  # the logs' clock
        cluster.procs["scheduler"].send_signal(signal.SIGKILL)
        for name, proc in cluster.procs.items():
            proc.wait(timeout=60)
    # (in BSP one worker's hold holds the others at the barrier: they need not hold themselves)
    held = [m.group(1) for w in range(2) if (m := re.search(r"^(\S+ \S+) .* waits until it is heard",
                                                            (run_dir / "logs" / f"worker{w}.log").read_text(), re.M))]
    if not held:
        raise SystemExit(f"scheduler: no worker held (run dir {run_dir})")
    held_at = min(datetime.datetime.strptime(h, "%Y-%m-%d %H:%M:%S,%f").timestamp() for h in held)
    root_dir = run_dir / "checkpoints"
    torn = [d for d in root_dir.iterdir() if not (d / "manifest.json").exists() and any(d.glob("shard-*.ckpt"))]
    return {"hold_s": held_at - killed_at, "torn": len(torn)}


def asplate_one(root: Path, k: int) -> dict:
    """ASP, worker 2 SIGKILLed once ASP_KILL_AT of the sample budget is done: the survivors take
    the rest and may finish before it is found silent, its loss then ending the job."""
    run_dir = root / f"asplate-{k}"
    job = ["--mode", "asp", "--epochs", str(ASP_EPOCHS), "--global-batch", str(GLOBAL_BATCH), "--seed", str(k),
           "--heartbeat", "0.2", "--dead-after", "2"]
    cluster = LocalCluster(run_dir, job, 2, [WorkerSpec(ms_per_step=20.0)] * 3)

    def late():
        events = _events(run_dir)
        budget = next((e["budget_samples"] for e in events if e["event"] == "start"), None)
        return budget and sum(e["batch"] for e in events if e["event"] == "step") >= ASP_KILL_AT * budget

    with cluster:
        cluster.start()
        _wait_until(late, 180, "the last part of the budget")
        killed_at = time.monotonic()
        cluster.procs["worker2"].send_signal(signal.SIGKILL)
        code = cluster.wait(JOB_TIMEOUT_S)
    events = read_events(run_dir)
    t0 = next(e["clock_t0"] for e in events if e["event"] == "start")
    budget = next(e["budget_samples"] for e in events if e["event"] == "start")
    lost = next(e for e in events if e["event"] == "membership" and e["change"] == "lost")
    end = next(e for e in events if e["event"] == "end")
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    log = (run_dir / "logs" / "scheduler.log").read_text()
    before = log[:log.find("worker 2 lost")] if "worker 2 lost" in log else log
    done = sum(e["batch"] for e in events if e["event"] == "step" and t0 + e["t"] <= killed_at)
    return {"code": code, "at": done / budget, "detect_s": t0 + lost["t"] - killed_at,
            "end_s": t0 + end["t"] - killed_at, "status": end["status"],
            "accuracy": summary.get("final_test_accuracy"), "model": (run_dir / "model.pt").exists(),
            "finished_first": len(re.findall(r"worker [01] finished", before))}


@contextlib.contextmanager
def _small_disk(where: Path, size: str):
    """`where`/run on a tmpfs of `size`, its logs/ bound to `where`/logs on the ordinary disk
    (a report that the disk is full must be readable); unmounted on the way out, failed or not."""
    run_dir, logs = where / "run", where / "logs"
    run_dir.mkdir(parents=True)
    logs.mkdir()
    mounted = []
    try:
        for args in (["-t", "tmpfs", "-o", f"size={size}", "tmpfs", run_dir], ["--bind", logs, run_dir / "logs"]):
            if args[0] == "--bind":
                (run_dir / "logs").mkdir()
            done = subprocess.run(["mount", *map(str, args)], capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"fulldisk: a small file system needs mount, which was refused: {done.stderr}")
            mounted.append(args[-1])
        yield run_dir
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", str(target)], check=True)


def _fill(directory: Path) -> Path:
    """A file that takes every free byte of `directory`'s file system."""
    path = directory / "filler"
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return path


def _log_times(path: Path, text: str) -> list[float]:
    """The times (time.time()'s clock) of `path`'s log lines that hold `text`."""
    return [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for line in path.read_text().splitlines() if text in line]


def fulldisk_one(root: Path, k: int) -> dict:
    """A BSP job whose run directory is on a tmpfs of FULL_DISK_SIZE, filled once a checkpoint
    is complete and freed FULL_S later: the first reports, the events lost, the end."""
    job = ["--mode", "bsp", "--max-steps", "600", "--global-batch", "32", "--seed", str(k),
           "--checkpoint-every", "20", "--heartbeat", "0.3"]
    with _small_disk(root / f"fulldisk-{k}", FULL_DISK_SIZE) as run_dir:
        cluster = LocalCluster(run_dir, job, 1, [WorkerSpec(ms_per_step=20.0)] * 2)
        with cluster:
            cluster.start()
            _wait_until(lambda: any(e["event"] == "checkpoint" and e["complete"] for e in _events(run_dir)),
                        180, "a complete checkpoint")
            filler = _fill(run_dir)
            full_at = time.time()  # the logs' clock
            time.sleep(FULL_S)  # the disk stays full
            filler.unlink()
            code = cluster.wait(JOB_TIMEOUT_S)
        logs = run_dir / "logs"
        said = {"metrics": _log_times(logs / "scheduler.log", f"cannot write {run_dir / 'metrics.jsonl'}"),
                "server": _log_times(logs / "server0.log", "not written"),
                "incomplete": _log_times(logs / "scheduler.log", "is incomplete")}
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        events = _events(run_dir)
        return {"code": code, "status": summary.get("status"), "events_lost": summary.get("events_lost"),
                **{f"{key}_s": (min(t) - full_at if t else None) for key, t in said.items()},
                "metrics_lines": len(_log_times(logs / "scheduler.log", "metrics.jsonl")),
                "failed": sum(e["event"] == "checkpoint" and not e["complete"] for e in events),
                "last_complete": any(e["event"] == "checkpoint" for e in events)
                and [e for e in events if e["event"] == "checkpoint"][-1]["complete"],
                "tmp": len(list(run_dir.rglob("*.tmp"))), "model": (run_dir / "model.pt").exists()}


def _sections(text: str) -> dict[str, str]:
    """A results file's parts by their heading ("" for the head before the first "## ")."""
    parts, key = {"": []}, ""
    for line in text.splitlines():
        if line.startswith("## "):
            key = line
            parts[key] = []
        parts[key].append(line)
    return {k: "\n".join(v).strip("\n") for k, v in parts.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--dead-after", default="1,2,5", help="comma-separated --dead-after values, seconds")
    p.add_argument("--checkpoint-every", default="5,10,20", help="comma-separated intervals for the server part")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parts", default="dead,restart,unreplaced,scheduler,stalls,asplate,fulldisk",
                   help="which measurements to run, comma-separated: dead, restart, unreplaced, scheduler, stalls, "
                        "asplate, fulldisk (it needs mount: root)")
    p.add_argument("--stall-heartbeats", default="0.25,1", help="comma-separated --heartbeat values, stalls part")
    p.add_argument("--out", type=Path, default=HERE / "results" / "failures.md")
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    values = [float(v) for v in args.dead_after.split(",")] if "dead" in parts else []
    start = time.monotonic()
    rows, restarts, unreplaced, stalls, killed, late, full = [], [], [], [], [], [], []
    with runs_dir("omnips-failures-") as root:
        for d in values:
            runs = [run_one(root, d, k) for k in range(args.repeats)]
            for r in runs:
                print(f"D {d:g} s: detected after {r['detect_s']:.2f} s, survivors stepped "
                      f"{r['resume_s']:.3f} s after that, {r['lost_samples']} samples missing", flush=True)
            rows.append((d, runs))
        for every in [int(v) for v in args.checkpoint_every.split(",")] if "restart" in parts else []:
            runs = [restart_one(root, every, k) for k in range(args.repeats)]
            for r in runs:
                print(f"K {every}: back to step {r['step']}, {r['lost']} steps lost, rewound "
                      f"{r['recover_s']:.2f} s after the kill", flush=True)
            restarts.append((every, runs))
        if "unreplaced" in parts:
            unreplaced = [unreplaced_one(root, k) for k in range(args.repeats)]
            for r in unreplaced:
                print(f"unreplaced: lost after {r['detect_s']:.2f} s, failed after {r['end_s']:.1f} s, "
                      f"{r['lost']} steps lost, said {r['said']} times", flush=True)
        if "scheduler" in parts:
            killed = [scheduler_one(root, k) for k in range(args.repeats)]
            for r in killed:
                print(f"scheduler killed: workers held {r['hold_s']:.2f} s after, {r['torn']} checkpoints "
                      "never complete", flush=True)
        for who in ("worker2", "server1") if "stalls" in parts else ():
            for hb in [float(v) for v in args.stall_heartbeats.split(",")]:
                runs = [stall_one(root, who, hb, k) for k in range(args.repeats)]
                for r in runs:
                    print(f"{who} stopped, --heartbeat {hb:g}: named after {r['named_s']:.2f} s, step held "
                          f"{r['held_s']:.2f} s", flush=True)
                stalls.append((who, hb, runs))
        if "asplate" in parts:
            late = [asplate_one(root, k) for k in range(args.repeats)]
            for r in late:
                print(f"ASP worker killed at {r['at']:.0%} of the budget: lost after {r['detect_s']:.2f} s, "
                      f"{r['finished_first']} survivors done first, ended after {r['end_s']:.2f} s, "
                      f"{r['status']}, accuracy {r['accuracy']}, model.pt {r['model']}", flush=True)
        if "fulldisk" in parts:
            full = [fulldisk_one(root, k) for k in range(args.repeats)]
            for r in full:
                print(f"full disk: metrics.jsonl reported after {r['metrics_s']:.2f} s, a checkpoint after "
                      f"{r['server_s']:.2f} s; {r['status']}, {r['events_lost']} events lost, "
                      f"{r['failed']} checkpoints incomplete, {r['tmp']} .tmp files", flush=True)
    command = f"`python benchmarks/failures.py {' '.join(sys.argv[1:])}` ({time.monotonic() - start:.0f} s)"
    old = _sections(args.out.read_text()) if args.out.exists() else {}
    new = {}
    if rows:
        new[""] = "\n".join(_dead_lines(rows, command))
    if restarts:
        new[RESTART] = "\n".join(_restart_lines(restarts))
    if unreplaced:
        new[UNREPLACED] = "\n".join(_unreplaced_lines(unreplaced, command))
    if killed:
        new[KILLED] = "\n".join(_killed_lines(killed, command))
    if stalls:
        new[STALLS] = "\n".join(_stall_lines(stalls, command))
    if late:
        new[ASPLATE] = "\n".join(_asplate_lines(late, command))
    if full:
        new[FULLDISK] = "\n".join(_fulldisk_lines(full, command))
    lines = []
    for key in ["", RESTART, UNREPLACED, KILLED, STALLS, ASPLATE, FULLDISK]:
        text = new.get(key, old.get(key))
        if text:
            lines += [text, ""]
    publish(lines[:-1], args.out)
    return 0


RESTART = "## A lost server, started again (BSP, 2 servers, 2 workers, --dead-after 2 s)"
UNREPLACED = "## A lost server nobody replaces (BSP, 2 servers, 2 workers, --dead-after 2 s)"
KILLED = f"## The scheduler killed (BSP, 2 workers, --heartbeat 1, --dead-after {SCHEDULER_DEAD_AFTER_S})"
STALLS = f"## A worker or a server stopped (SIGSTOP) for {STOP_S:g} s (BSP, 2 servers, 3 workers)"
ASPLATE = "## An ASP worker killed near the end of the job (ASP, 2 servers, 3 workers, --dead-after 2 s)"
FULLDISK = (f"## A full disk under the run directory (BSP, 1 server, 2 workers, tmpfs of {FULL_DISK_SIZE}, "
            f"full for {FULL_S:g} s)")


def _dead_lines(rows, command) -> list[str]:
    lines = [
        "# Dead workers and lost servers: detection and cost (BSP)", "",
        *machine_lines(),
        f"- command: {command}",
        f"- job: BSP, mlp on digits, 3 workers on 20 ms virtual steps, --global-batch {GLOBAL_BATCH}; "
        f"worker 2 SIGKILLed after {KILL_AFTER_STEPS} steps; --heartbeat D/5", "",
        "| --dead-after D (s) | runs | detection (s), median | detection / D | survivors' next step after the "
        "loss (s) | samples missing |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for d, runs in rows:
        det = statistics.median(r["detect_s"] for r in runs)
        resume = statistics.median(r["resume_s"] for r in runs)
        lost = "/".join(str(r["lost_samples"]) for r in runs)
        lines.append(f"| {d:g} | {len(runs)} | {det:.2f} | {det / d:.2f} | {resume:.3f} | {lost} |")
    return lines + ["", "Samples missing: the dead worker's slice (16 of 48) of each step after its last report: "
                    "the step in flight, which is not learned from, and, when the kill fell between a push and "
                    "its report, the step before, which was learned but never reported."]


def _restart_lines(restarts) -> list[str]:
    lines = [RESTART, "", "| --checkpoint-every K | runs | step reached -> checkpoint gone back to | steps lost "
              "| kill to rewind (s), median |",
              "|---:|---:|---|---|---:|"]
    for every, runs in restarts:
        where = ", ".join(f"{r['step'] + r['lost']} -> {r['step']}" for r in runs)
        lost = "/".join(str(r["lost"]) for r in runs)
        lines.append(f"| {every} | {len(runs)} | {where} | {lost} | "
                     f"{statistics.median(r['recover_s'] for r in runs):.2f} |")
    return lines + ["", "Steps lost are those between the newest complete checkpoint and the step reached when "
                    "the server died (fewer than K, or up to 2K while the newest is still being written); where "
                    "the kill falls in the interval is chance. Kill to rewind: --dead-after (2 s), the new "
                    "server's start-up (a Python process importing torch) and the restores."]


def _unreplaced_lines(runs, command) -> list[str]:
    med = statistics.median
    return [UNREPLACED, "", *machine_lines(), f"- command: {command}",
            f"- job: BSP, mlp on digits, 2 workers on 20 ms virtual steps (--server-timeout "
            f"{WORKER_SERVER_TIMEOUT_S} s), --checkpoint-every 10, --heartbeat 0.4; server 1 SIGKILLed after 37 "
            "steps, none started again", "",
            "| runs | kill to `lost` (s), median | kill to the job's end (s), median | steps lost | "
            "\"the job waits for ...\" lines |", "|---:|---:|---:|---|---|",
            f"| {len(runs)} | {med(r['detect_s'] for r in runs):.2f} | {med(r['end_s'] for r in runs):.1f} | "
            f"{'/'.join(str(r['lost']) for r in runs)} | {'/'.join(str(r['said']) for r in runs)} |", "",
            "The job ends once the workers give up on the server, after their --server-timeout from their last "
            "push, each telling the scheduler (failed), with the reason: server 1 was lost and no server took "
            "its shard. It used to end with \"every worker is gone\" after the workers' silence, 2 minutes "
            "with the default --server-timeout (120 s) and --dead-after (30 s). Steps lost: those since the "
            "newest complete checkpoint, which --resume goes back to."]


def _killed_lines(runs, command) -> list[str]:
    med = statistics.median
    return [KILLED, "", *machine_lines(), f"- command: {command}",
            "- job: BSP, mlp on digits, 2 workers on 100 ms virtual steps, 1 server, --checkpoint-every 2; the "
            "scheduler SIGKILLed after 40 steps", "",
            "| runs | kill to the workers' hold (s), median | checkpoints begun that never complete |",
            "|---:|---:|---|",
            f"| {len(runs)} | {med(r['hold_s'] for r in runs):.2f} | {'/'.join(str(r['torn']) for r in runs)} |", "",
            "The workers take no step once the scheduler has been quiet for two heartbeat intervals; they give "
            f"up after --dead-after ({SCHEDULER_DEAD_AFTER_S} s). Before, they trained on for all of it, and the "
            "server began every checkpoint asked in advance (32 at most, scheduler/service.py's "
            "CHECKPOINTS_AHEAD) that no manifest could complete: the same job on commit bd0504c, before the "
            "hold, left 32/32 (2026-12-02, two runs)."]


def _stall_lines(stalls, command) -> list[str]:
    med = statistics.median
    lines = [STALLS, "", *machine_lines(), f"- command: {command}",
             "- job: BSP, mlp on digits, 3 workers on 20 ms virtual steps, 2 servers, --dead-after 30; the "
             f"process stopped after 40 steps and woken {STOP_S:g} s later", "",
             "| process stopped | --heartbeat (s) | runs | stop to the `wait` event naming it (s), median "
             "| in heartbeat intervals | longest gap between steps (s), median |", "|---|---:|---:|---:|---:|---:|"]
    for who, hb, runs in stalls:
        named = med(r["named_s"] for r in runs)
        lines.append(f"| {who} | {hb:g} | {len(runs)} | {named:.2f} | {named / hb:.1f} | "
                     f"{med(r['held_s'] for r in runs):.2f} |")
    return lines + ["", "Named: the scheduler's first `wait` event for the stopped process after the stop (its log "
                    "says \"step N waits for worker 2 (host, cpu) for S s\"). Before, no process said anything "
                    "until it woke. The longest gap is the work lost: every worker idle while the step waits."]


def _each(runs, show) -> str:
    """One figure per run, "/"-separated."""
    return "/".join(show(r) for r in runs)


def _asplate_lines(runs, command) -> list[str]:
    med = statistics.median
    at = _each(runs, lambda r: f"{r['at']:.0%}")
    first = _each(runs, lambda r: str(r["finished_first"]))
    status = _each(runs, lambda r: r["status"])
    accuracy = _each(runs, lambda r: "-" if r["accuracy"] is None else f"{r['accuracy']:.3f}")
    model = _each(runs, lambda r: "yes" if r["model"] else "no")
    return [ASPLATE, "", *machine_lines(), f"- command: {command}",
            f"- job: ASP, mlp on digits, 3 workers on 20 ms virtual steps, --epochs {ASP_EPOCHS:g}, --global-batch "
            f"{GLOBAL_BATCH}, --heartbeat 0.2; worker 2 SIGKILLed once {ASP_KILL_AT:.0%} of the sample budget is "
            "reported in metrics.jsonl", "",
            "| runs | budget done at the kill | survivors done before the loss | kill to `lost` (s), median | "
            "kill to `end` (s), median | status | final test accuracy | model.pt |",
            "|---:|---|---|---:|---:|---|---|---|",
            f"| {len(runs)} | {at} | {first} of 2 | {med(r['detect_s'] for r in runs):.2f} | "
            f"{med(r['end_s'] for r in runs):.2f} | {status} | {accuracy} | {model} |", "",
            "Kill to `lost`: --dead-after (2 s) of silence and the scheduler's look. In these runs the survivors "
            "took the rest of the budget and reported done before worker 2 was found silent, so its loss is what "
            "completed the job and asked the final evaluation. The same job run on the tree of commit c3bb0e3 "
            "(the one before bd34e37) ended `failed: servers did not answer the final evaluation pull within "
            "120 s` 122.1 s after the kill, without final_test_accuracy or model.pt (2026-12-02, one run, "
            "killed at 91% of the budget, both "
            "survivors done first)."]


def _fulldisk_lines(runs, command) -> list[str]:
    med = statistics.median
    said = _each(runs, lambda r: str(r["metrics_lines"]))
    failed = _each(runs, lambda r: str(r["failed"]))
    newest = _each(runs, lambda r: "yes" if r["last_complete"] else "no")
    status = _each(runs, lambda r: str(r["status"]))
    lost = _each(runs, lambda r: str(r["events_lost"]))
    tmp = _each(runs, lambda r: str(r["tmp"]))
    return [FULLDISK, "", *machine_lines(), f"- command: {command}",
            "- job: BSP, mlp on digits, 2 workers on 20 ms virtual steps, --max-steps 600, --global-batch 32, "
            f"--checkpoint-every 20, --heartbeat 0.3; the run directory on a tmpfs of {FULL_DISK_SIZE} (its logs/ on "
            f"the ordinary disk), filled by a file once a checkpoint is complete, the file removed {FULL_S:g} s later",
            "",
            "| runs | full to the scheduler's `cannot write` metrics.jsonl line (s), median | full to server 0's "
            "first `checkpoint N not written` (s), median | full to the scheduler's `checkpoint N is incomplete` "
            "(s), median | metrics.jsonl lines in the scheduler's log | checkpoints incomplete | newest checkpoint "
            "complete | summary.json status | events_lost | `*.tmp` left |",
            "|---:|---:|---:|---:|---|---|---|---|---|---|",
            f"| {len(runs)} | {med(r['metrics_s'] for r in runs):.2f} | {med(r['server_s'] for r in runs):.2f} | "
            f"{med(r['incomplete_s'] for r in runs):.2f} | {said} | {failed} | {newest} | {status} | {lost} | {tmp} |",
            "", "The scheduler says once that it cannot write metrics.jsonl and once that it is written again "
            "(2 lines): its events wait in memory meanwhile (up to 64 MiB, later ones dropped and counted in "
            "events_lost). Server 0 says each checkpoint it cannot write, leaves it incomplete (the scheduler says "
            "so) and trains on; the newest checkpoint, taken after the file's removal, is complete. The first "
            "reports come at the scheduler's next write of metrics.jsonl (every --heartbeat) and the next "
            "checkpoint's."]

if __name__ == "__main__":
    sys.exit(main())
