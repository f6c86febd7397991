"""What every benchmark shares: the head of its results file, publishing it, and a
directory for its runs."""

import contextlib
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def machine_lines() -> list[str]:
    """The date, the code and the machine, for the head of a results file."""
    return [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"- code: {code_version()}",
            f"- nproc: {len(os.sched_getaffinity(0))}, {platform.machine()}, Python {platform.python_version()}"]


def code_version() -> str:
    """The commit this checkout is at, and whether its tracked files were changed since: what
    a results file measured (the controller changes between runs)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(HERE), *args], capture_output=True, text=True, timeout=30)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode:
            return f"unknown (not a git checkout: {head.stderr.strip()})"
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    return head.stdout.strip() + (", with uncommitted changes" if changed else "")


def publish(lines: list[str], out: Path) -> None:
    """Print the results and write them to `out`."""
    text = "\n".join(lines) + "\n"
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


@contextlib.contextmanager
def runs_dir(prefix: str, keep: bool = False):
    """A fresh directory for a benchmark's runs: removed once it succeeds (unless `keep`),
    kept and named on stderr when it fails, since the runs' logs then say why."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield root
    except BaseException:
        print(f"run directories kept in {root}", file=sys.stderr)
        raise
    if keep:
        print(f"run directories kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
