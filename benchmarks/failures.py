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
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from fault_runs import (ASP_EPOCHS, ASP_KILL_AT, FULL_DISK_SIZE, FULL_S, GLOBAL_BATCH, KILL_AFTER_STEPS,  # noqa: E402
                        SCHEDULER_DEAD_AFTER_S, STOP_S, WORKER_SERVER_TIMEOUT_S, asplate_one, fulldisk_one,
                        restart_one, run_one, scheduler_one, stall_one, unreplaced_one)
from report import machine_lines, publish, runs_dir  # noqa: E402


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
