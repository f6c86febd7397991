"""One log format for every role: time, role and rank, level, message, on stderr."""

import logging
import sys


def setup(role: str, level: str = "INFO") -> None:
    logging.basicConfig(stream=sys.stderr, level=level.upper(),
                        format=f"%(asctime)s omnips-{role} %(levelname)s %(message)s", force=True)
