#!/usr/bin/env python3
"""Start a whole omnips cluster on this machine and show its progress.

Same as `omnips launch`; run `scripts/launch_local.py --help` for the options.
Example: scripts/launch_local.py --num-workers 3 --slowdown 1 2 4 --mode bsp --epochs 10
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from omnips.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["launch", *sys.argv[1:]]))
