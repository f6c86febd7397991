"""The cgroup benchmark's table and verdicts (benchmarks/cgroup_report.py), on made-up runs: each
case's repeats averaged, the dynamic job's run alone judged beside the one among the others;
the efficiency from step 1 on beside the whole job's; the windows in which the dynamic job ran a
plan slower than the uniform job beside it (benchmarks/worse_windows.py); and the jobs' wait for
their servers before the case's workers start (benchmarks/cgroup.py)."""

import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import cgroup  # noqa: E402
import cgroup_report  # noqa: E402
from efficiency import Scenario, analyse  # noqa: E402
from worse_windows import longest_worse, timeline  # noqa: E402


def _run(case: str, variant: str, efficiency: float, wall_s: float) -> dict:
    return {"case": case, "variant": variant, "wall_s": wall_s, "efficiency": efficiency,
            "steps_efficiency": efficiency + 0.04, "balance": 0.9,
            "final": [32, 32, 32, 32], "adjustments": 0, "throttled": 7, "overhead_ms": [20.0, 10.0]}


def _repeat(case: str, dynamic: float, alone: float | None, uniform_s: float = 100.0, dynamic_s: float = 90.0):
    runs = [_run(case, "uniform", 0.6, uniform_s), _run(case, "affine", dynamic, dynamic_s),
            _run(case, "static", 0.85, 91.0)]
    if alone is not None:
        runs[1]["alone"] = _run(case, "affine", alone, 80.0)
    return runs


def test_the_targets_are_judged_on_each_case_s_mean_beside_the_others_and_alone():
    results = [*_repeat("HL2", 0.88, 0.93), *_repeat("HL2", 0.90, 0.91),
               *_repeat("HL8", 0.86, 0.92), *_repeat("HL8", 0.85, 0.89),
               *_repeat("neighbour", 0.80, 0.86), *_repeat("neighbour", 0.82, 0.85, dynamic_s=103.0)]
    lines = cgroup_report.verdicts(results)
    assert lines[0] == "- dynamic / uniform, worst run: 1.030 (target <= 1.02): missed"
    assert lines[1].startswith("- the controller's efficiency at HL2-HL8: mean over repeats, lowest case HL8 0.855 "
                               "(target >= 0.9): missed (lowest single run 0.850)")
    assert lines[2] == ("- the controller's efficiency at HL2-HL8, its job alone on the host: mean over repeats, "
                        "lowest case HL8 0.905 (target >= 0.9): met (lowest single run 0.890)")
    assert lines[3].startswith("- with a noisy neighbour: mean over repeats, lowest case neighbour 0.810 "
                               "(target >= 0.85): missed")
    assert lines[4].endswith("lowest case neighbour 0.855 (target >= 0.85): met (lowest single run 0.850)")
    table = cgroup_report.table(results, 2)
    assert [row.split(" | ")[10] for row in table[2:4]] == ["0.930", "0.910"]  # the alone column
    # from step 1 on (the start left out): dynamic, static, dynamic alone
    assert [row.split(" | ")[11] for row in table[2:4]] == ["0.920, 0.890, 0.970", "0.940, 0.890, 0.950"]


def test_the_efficiency_from_step_1_leaves_the_start_out():
    """Two workers, each step's ideal 1 s (20 samples at 10 + 10 a second), steps ending at 5, 6.5
    and 8 s of a 10 s job: 3 s of ideal in 10 s, and steps 1-2 took 3 s for 2 s of ideal."""
    events = [{"event": "step", "step": s, "worker": w, "batch": 10, "compute_s": 1.0, "t": end}
              for s, end in enumerate([5.0, 6.5, 8.0]) for w in range(2)]
    a = analyse(events, {"num_workers": 2, "steps": 3, "wall_s": 10.0},
                Scenario("HL1", ("1",) * 2, (1.0, 1.0), ("--max-steps", "3"), ((1.0, 1.0),)))
    assert a["efficiency"] == pytest.approx(0.3) and a["steps_efficiency"] == pytest.approx(2 / 3)


def test_without_the_alone_runs_their_column_is_empty_and_no_verdict_claims_them():
    results = [*_repeat("HL4", 0.9, None), *_repeat("HL4", 0.92, None)]
    assert not any("alone" in line for line in cgroup_report.verdicts(results))
    assert cgroup_report.table(results, 2)[2].split(" | ")[10:12] == ["-", "0.940, 0.890"]


def test_a_job_s_workers_wait_for_its_servers_and_stop_waiting_when_the_case_fails(tmp_path):
    failed = threading.Event()
    with pytest.raises(SystemExit, match="0 of 1 server"):  # (no metrics file yet, and no time left)
        cgroup.servers_joined(tmp_path, 1, failed, timeout_s=0.0)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"event": "start", "t": 0.0}) + "\n" + json.dumps(
        {"event": "membership", "t": 1.0, "change": "joined", "role": "server", "rank": 0}) + "\n")
    assert cgroup.servers_joined(tmp_path, 1, failed, timeout_s=0.0)
    failed.set()
    assert not cgroup.servers_joined(tmp_path, 2, failed, timeout_s=0.0)


UNIFORM, OFF = (32, 32, 32, 32), (40, 24, 32, 32)


def _timeline(step_s: list[float], plans: list[tuple], start: float = 100.0) -> list:
    """Steps 0..len(step_s): step s ends step_s[s - 1] after step s - 1 (step 0 at `start`)."""
    ends = [start]
    for dt in step_s:
        ends.append(ends[-1] + dt)
    return [(s, end, plans[s]) for s, end in enumerate(ends)]


def test_a_plan_other_than_uniform_that_ran_slower_than_uniform_batches_counts_window_by_window():
    uniform = _timeline([1.0] * 60, [UNIFORM] * 61)
    # steps 1-30 (three windows of 10) at another plan, 3 % slower; then 10 steps 3 % slower at the
    # uniform split (the same plan as the uniform job's: not a worse plan); then 1 % slower (noise)
    plans = [UNIFORM] + [OFF] * 30 + [UNIFORM] * 10 + [OFF] * 10
    dynamic = _timeline([1.03] * 40 + [1.01] * 10, plans)
    assert longest_worse(dynamic, uniform, 10, 0.02) == (3, 5)
    # a window in which the plan changes back counts as the plan's
    plans[20] = UNIFORM
    assert longest_worse(dynamic, uniform, 10, 0.02) == (3, 5)
    # the uniform job ended after 20 s: windows from then on are not compared
    assert longest_worse(dynamic, uniform[:21], 10, 0.02) == (2, 2)
    assert longest_worse(_timeline([0.5] * 50, [UNIFORM] + [OFF] * 50), uniform, 10, 0.02) == (0, 5)


def test_a_job_s_timeline_is_its_complete_steps_on_the_host_s_clock():
    events = [{"event": "start", "t": 0.0, "clock_t0": 1000.0}]
    events += [{"event": "step", "step": s, "worker": w, "batch": 10 + w, "t": 2.0 + s + w / 10}
               for s in range(3) for w in range(2) if (s, w) != (2, 1)]
    steps = timeline(events, 2)
    assert [(s, batches) for s, _, batches in steps] == [(0, (10, 11)), (1, (10, 11))]
    assert [end for _, end, _ in steps] == pytest.approx([1002.1, 1003.1])


def test_the_verdict_judges_the_longest_run_of_worse_windows_in_any_job():
    results = [*_repeat("HL1", 0.9, None), *_repeat("HL1", 0.9, None)]
    uniform = _timeline([1.0] * 60, [UNIFORM] * 61)
    for g, dynamic in enumerate([_timeline([1.03] * 20, [UNIFORM] + [OFF] * 20),
                                 _timeline([1.03] * 30 + [1.0] * 10, [UNIFORM] + [OFF] * 40)]):
        results[3 * g]["timeline"], results[3 * g + 1]["timeline"] = uniform, dynamic
    line = [v for v in cgroup_report.verdicts(results) if v.startswith("- windows")]
    assert line == ["- windows of 10 steps in which the dynamic job ran a plan other than the uniform split more "
                    "than 2% slower than the uniform job at the same moment, longest run in any job: 3 "
                    "(target <= 2; 6 windows compared): missed"]
