"""The head of every results file names the code it measured (benchmarks/report.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402

pytestmark = pytest.mark.cluster  # it runs git


def test_a_results_file_names_the_commit_it_measured():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    line = next(x for x in report.machine_lines() if x.startswith("- code: "))
    assert line.removeprefix("- code: ").split(",")[0] == head


def test_outside_a_checkout_the_code_is_unknown_and_says_why(tmp_path):
    shutil.copy(ROOT / "benchmarks" / "report.py", tmp_path / "copied_report.py")
    out = subprocess.run([sys.executable, "-c", "import copied_report; print(copied_report.code_version())"],
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.startswith("unknown (not a git checkout"), out
