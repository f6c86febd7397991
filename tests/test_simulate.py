"""benchmarks/simulate.py: the controller driven with modelled workers reports what it claims."""

import sys
from pathlib import Path

import pytest

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


def test_the_probe_plans_the_first_step_and_without_it_equal_batches_take_an_adjustment():
    probed, equal = (simulate.simulate(4, 80, 0.0, "timer", 5, 0, (0.5, 2.5), 32, probe) for probe in (True, False))
    # exact passes of 2 and 4 samples give the true lines: the oracle's plan from step 0 on
    assert probed["clean"][0] == pytest.approx(probed["oracle_clean"][0])
    assert simulate.summarise(probed)["first"] == 0
    assert equal["clean"][0] > 4 * equal["oracle_clean"][0]  # equal batches wait for the slowest
    assert simulate.summarise(equal)["first"] == 1


@pytest.mark.parametrize("flags, start", [([], "- start: the probe, one pass of 2 and 4 samples"),
                                          (["--no-probe"], "- start: equal batches (--no-probe)")])
def test_the_table_has_a_row_per_scenario_and_kind_of_noise(tmp_path, flags, start):
    out = tmp_path / "simulate.md"
    assert simulate.main(["--workers", "4,8", "--steps", "40", *flags, "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(simulate.SCENARIOS) * 2 * len(simulate.KINDS)
    assert all(len(row.split("|")) == 15 for row in rows)  # 13 columns
    assert start in text
