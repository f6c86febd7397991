"""benchmarks/vs_ddp.py end to end in its smallest mode: DDP ranks and an omnips cluster."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import WAIT_FACTOR

pytestmark = pytest.mark.cluster  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent


def test_vs_ddp_quick_writes_its_tables(tmp_path):
    out = tmp_path / "vs_ddp.md"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_ddp.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=240 * WAIT_FACTOR)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert "- nproc: " in text and "load average" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| digits | 4:2:1 | ")]
    results = {r[2]: r for r in rows if r[2] in ("ddp-equal", "ddp-ideal", "omnips")}
    assert len(results) == 3 and all(len(r) == 12 for r in results.values()), rows
    for r in results.values():
        assert int(r[4]) == 12  # steps: ceil(1438 / 128)
        numbers = [float(v) for v in r[5:11]] + [float(r[11].rstrip(" |"))]
        assert all(math.isfinite(v) for v in numbers) and all(v > 0 for v in numbers[:4]), r
    # equal batches for (a); (b) and omnips end at the equal-time plan of F = 1/2/4
    assert results["ddp-equal"][3] == "43/43/42" and results["ddp-ideal"][3] == "81/35/12"
    # the same model on the same samples: DDP's loss scaling makes unequal batches the global mean
    losses = [float(r[11].rstrip(" |")) for r in results.values()]
    assert max(losses) - min(losses) < 1e-3 * min(losses), losses
    targets = [line for line in text.splitlines() if line.startswith("| digits | 4:2:1 | (c)/")]
    assert len(targets) == 2 and all(line.endswith(("| met |", "| missed |")) for line in targets)
