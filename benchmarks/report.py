"""What every benchmark's results file starts and ends with."""

import datetime
import os
import platform
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
