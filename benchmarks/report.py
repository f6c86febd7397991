"""What every benchmark shares: the head of its results file, publishing it, and a
directory for its runs."""

import contextlib
import datetime
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path


def machine_lines() -> list[str]:
    """The date and the machine, for the head of a results file."""
    return [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
            f"- nproc: {len(os.sched_getaffinity(0))}, {platform.machine()}, Python {platform.python_version()}"]


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
