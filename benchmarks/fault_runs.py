"""benchmarks/failures.py's fault injections: each starts a job, does it harm (a SIGKILL, a
SIGSTOP, a full disk) and reads what followed from the job's events and logs (what each
measures: benchmarks/failures.py's docstring)."""

import contextlib
import datetime
import errno
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
