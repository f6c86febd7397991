"""Checks of a message's fields, as every op's `check()` applies them to what arrives from
the network: counts, bounded numbers (NaN refused), measured times, short printable
lines, parts within their shard; and `brief`, a value cut short for a refusal's text."""

import reprlib

# Measured times (a pass, a step's compute, a wait) and batch sizes from the network: a time above 0
# but under a nanosecond is no timer's reading and one over 11 days no step's, and no worker holds 2**31
# samples in one pass. Such values (subnormal times, a batch of 2**63) would make a time model's slope
# 0 or its plan unsolvable, failing the job, or make one report count a whole job's samples.
MIN_SECONDS, MAX_SECONDS = 1e-9, 1e6
MAX_SPREAD = MAX_SECONDS / MIN_SECONDS - 1  # how much longer one measured time can be than another
MAX_BATCH = 1 << 31


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlevel = 2


def brief(value) -> str:
    """repr(value) cut short: a refusal's text is logged and sent back, so it must not
    echo a megabyte that a sender put in a field."""
    return _REPR.repr(value)


def check_place(msg) -> None:
    """A Push or Params in parts: its offset and values lie within its shard."""
    if not msg.whole and msg.offset:
        raise ValueError("only a part (whole > 0) has an offset")
    if msg.whole and not (msg.data.size and msg.offset + msg.data.size <= msg.whole):
        raise ValueError(f"a part needs values within its shard: {msg.data.size} at {msg.offset} of {msg.whole}")


def local_endpoints_ok(local: tuple, servers: tuple) -> bool:
    """`local` is empty (a sender that knows none) or one (hostname, "ipc://..." or "")
    pair per server: the ipc endpoints of Rewind and of a welcome's cluster map."""
    return not local or len(local) == len(servers) and all(e == "" or e.startswith("ipc://") for _, e in local)


def count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def short_line(msg, name: str, top: int) -> None:
    """A text from the network that is logged: one line of at most `top` characters."""
    text = getattr(msg, name)
    if len(text) > top or not text.isprintable():
        raise ValueError(f"{name} must be one printable line of at most {top} characters, not {brief(text)}")


def non_negative(msg, *names):
    for name in names:
        if not 0 <= getattr(msg, name) < float("inf"):  # also refuses NaN
            raise ValueError(f"{name} must be finite and >= 0, not {getattr(msg, name)}")


def at_most(msg, top, *names):
    for name in names:
        if not 0 <= getattr(msg, name) <= top:  # also refuses NaN
            raise ValueError(f"{name} must be from 0 to {top:g}, not {getattr(msg, name)}")


def measured(seconds: float) -> bool:
    return MIN_SECONDS <= seconds <= MAX_SECONDS
