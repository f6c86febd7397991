"""benchmarks/simulate.py: the controller driven with modelled workers reports what it claims."""

import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import simulate  # noqa: E402


def test_without_noise_the_plan_settles_on_the_oracles_and_follows_a_change_at_once():
    s = simulate.summarise(simulate.simulate(4, 80, 0.0, "timer", 5, 0, (0.5, 2.5), 32))
    assert abs(s["settled"] - 1.0) < 0.002  # exact times: the oracle's plan, up to whole samples
    assert abs(s["calm_vs_oracle"] - 1.0) < 0.002  # and, before the change, its step times
    assert s["after_change"] == 1
    # the change is seen on 3 far-off steps (CHANGE_STEPS), and the new plan runs 2 steps later
    assert s["old_plan_steps"] == 4


def test_the_table_has_a_row_per_scenario_and_kind_of_noise(tmp_path):
    out = tmp_path / "simulate.md"
    assert simulate.main(["--workers", "4,8", "--steps", "40", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(simulate.SCENARIOS) * 2 * len(simulate.KINDS)
    assert all(len(row.split("|")) == 15 for row in rows)  # 13 columns
