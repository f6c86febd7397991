#!/usr/bin/env python3
"""The README's picture of the status page: a real job on this machine (4 emulated workers,
dynamic batching, worker 3 turning four times slower at step 60), its page loaded in
headless Chromium once the plan has followed the change, then the job stopped.

    scripts/status_screenshot.py [--out docs/status-page.png]

Needs Chromium (Debian: apt-get install chromium).
"""

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from omnips import headless  # noqa: E402
from omnips.launch import LocalCluster, WorkerSpec  # noqa: E402

WAIT_S = 600.0


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "status.json", timeout=10) as r:
        return json.loads(r.read())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "status-page.png")
    p.add_argument("--after-step", type=int, default=140, help="take the picture once the job is past this step")
    args = p.parse_args()
    browser = headless.find_chromium()
    if browser is None:
        print("status_screenshot: no Chromium found (apt-get install chromium)", file=sys.stderr)
        return 1
    workers = [WorkerSpec(ms_per_step=4, ms_per_sample=0.5, slowdown=s) for s in ("1", "1", "2", "0:1,60:4")]
    with tempfile.TemporaryDirectory(prefix="omnips-screenshot-") as tmp:
        cluster = LocalCluster(Path(tmp) / "run", ["--batching", "dynamic", "--global-batch", "128", "--epochs", "40",
                                                   "--adjust-every", "10", "--register-timeout", "60"], 1, workers)
        try:
            cluster.start()
            deadline = time.monotonic() + WAIT_S
            while status(cluster.status_url)["progress"]["steps"] < args.after_step:
                ended = [name for name, code in cluster.exit_codes().items() if code is not None]
                if ended or time.monotonic() > deadline:
                    name = ended[0] if ended else "scheduler"
                    print(f"status_screenshot: {'; '.join(ended) or 'nothing'} exited, or the job stalled, "
                          f"before step {args.after_step}: {name}: {cluster.tail(name)}", file=sys.stderr)
                    return 1
                time.sleep(0.5)  # polling a running job's progress
            path = headless.screenshot(browser, cluster.status_url, args.out, size=(1280, 1040))
        finally:
            if cluster.poll() is None:
                cluster.procs["scheduler"].send_signal(signal.SIGTERM)
            cluster.stop(grace_s=20)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
