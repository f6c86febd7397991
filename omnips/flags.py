"""Command-line value types shared by the roles' parsers."""

import argparse
import ipaddress
import os
import re

from .routes import TRANSPORTS
from .security import Keys, KeysError


def _seconds_below(top: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not 0 < value < top:  # (NaN, inf and 0 would disable a timeout)
            raise argparse.ArgumentTypeError(f"must be a positive number of seconds below {top:g}")
        return value
    return parse


seconds = _seconds_below(1e6)  # timeouts and intervals: some become ZeroMQ polls, in int32 milliseconds
duration = _seconds_below(1e9)  # how long a whole job may run: deadlines on the monotonic clock only


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def size(text: str) -> int:
    """A positive number of bytes, with an optional K, M, G or T suffix (powers of 1024)."""
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = body[-1] if body[-1:] in ("K", "M", "G", "T") else ""
    try:
        value = float(body[:-1] if unit else body) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a K, M, G or T suffix") from None
    if not 1 <= value < 2**60:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be from 1 byte to 1 EiB")
    return int(value)


def nonempty(text: str) -> str:
    """A path or name that must be given: an empty one would silently mean the current
    directory, a default, or no value at all."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def port(text: str) -> int:
    """A TCP port, 0 for any free one (a larger number would wrap around in the bind)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port: use 0 to 65535 (0: any free one)")
    return value


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host(text: str) -> str:
    """An address to bind: an IPv4 or IPv6 address (brackets, as in a URL, dropped) or a
    host name. What is neither is refused here, before a process starts, and not by a bind
    that fails later with less to say."""
    name = text.strip()
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    labels = name.removesuffix(".").split(".")
    # a last label of digits only is a mistyped IPv4 address (1.2.3.999), never a domain
    if ":" not in name and len(name) <= 253 and all(_LABEL.fullmatch(x) for x in labels) \
            and not labels[-1].isdigit():
        return name
    hint = " (an address alone: the port has a flag of its own)" if ":" in name else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not an IP address or host name{hint}")


def add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="what each process logs (default INFO)")


def add_security(p: argparse.ArgumentParser, listens: bool) -> None:
    """--keys and --token, the same on every role; `listens`: the role binds a port."""
    def keys(text: str) -> Keys:
        try:
            return Keys.load(text, listens)
        except KeysError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p.add_argument("--keys", type=keys, default=None, metavar="DIR",
                   help="CURVE-encrypt and authenticate every connection with the keys in DIR "
                        "(made by 'omnips keygen DIR'); default: plain TCP")
    p.add_argument("--token", default=os.environ.get("OMNIPS_TOKEN", ""),
                   help="job token: the scheduler refuses processes whose token differs "
                        "(default: $OMNIPS_TOKEN, which unlike this flag no other user sees in ps)")


def add_transport(p: argparse.ArgumentParser) -> None:
    """--transport, for the roles that connect to servers (workers, the scheduler)."""
    default = os.environ.get("OMNIPS_TRANSPORT", "auto")
    if default not in TRANSPORTS:
        p.error(f"OMNIPS_TRANSPORT={default!r}: use one of {', '.join(TRANSPORTS)}")
    p.add_argument("--transport", choices=TRANSPORTS, default=default,
                   help="how to reach a server on this host: auto takes its unix socket (ipc://, faster), "
                        "tcp always uses tcp; servers on other hosts are reached over tcp either way "
                        "(default: $OMNIPS_TRANSPORT, else auto)")


def parse_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """p.parse_args(argv), naming an unknown flag before a missing required one: argparse
    reports only the missing one, so a mistyped `--schedular` read as `--scheduler` missing."""
    required = [a for a in p._actions if a.required]
    for a in required:
        a.required = False
    try:
        args, unknown = p.parse_known_args(argv)
    finally:
        for a in required:
            a.required = True
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in required if getattr(args, a.dest) is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    return args
