"""Headless Chromium for the status page's test and its screenshot (scripts/status_screenshot.py).

`--virtual-time-budget` lets the page's script run (its fetch of /status.json and the
render) before the DOM is dumped or the screenshot taken.
"""

import os
import shutil
import subprocess
from pathlib import Path

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
RUN_TIMEOUT_S = 120.0


def find_chromium() -> str | None:
    """$OMNIPS_CHROMIUM, else the first of NAMES on PATH; None if there is none."""
    given = os.environ.get("OMNIPS_CHROMIUM")
    if given:
        return shutil.which(given)
    return next((path for path in map(shutil.which, NAMES) if path), None)


def _run(browser: str, url: str, *args: str, budget_ms: int, cwd=None) -> str:
    argv = [browser, "--headless", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            f"--virtual-time-budget={budget_ms}", *args, url]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        argv.insert(1, "--no-sandbox")  # Chromium refuses to start as root with its sandbox (CI runs as root)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=cwd,
                          stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(browser).name} exited {done.returncode} on {url}: {tail}")
    return done.stdout


def dump_dom(browser: str, url: str, budget_ms: int = 3000) -> str:
    """The page's DOM after its scripts ran for `budget_ms` of virtual time."""
    return _run(browser, url, "--dump-dom", budget_ms=budget_ms)


def screenshot(browser: str, url: str, path, size=(1280, 1000), budget_ms: int = 3000) -> Path:
    """A PNG of the page at `path` (window `size`), after its scripts ran."""
    path = Path(path).resolve()
    _run(browser, url, f"--window-size={size[0]},{size[1]}", f"--screenshot={path}", budget_ms=budget_ms,
         cwd=path.parent)
    if not path.exists():
        raise RuntimeError(f"{Path(browser).name} wrote no screenshot to {path}")
    return path
