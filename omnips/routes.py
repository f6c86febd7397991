"""Which of a server's endpoints a client connects to.

Every server listens on tcp and, for clients on its own host, on a unix socket
(ipc://, faster for large shards: docs/performance.md). A client on the server's
host (same hostname) takes the ipc endpoint when it can open it; any other takes
tcp. `--transport tcp` (or OMNIPS_TRANSPORT=tcp) keeps every client on tcp.
"""

import logging
import os
import socket as pysocket
import stat

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "tcp")


def choose(tcp: str, server_host: str, ipc: str, my_host: str, transport: str, can_open) -> tuple[str, str]:
    """The endpoint to connect to and why. `ipc` is "" when the server offers none;
    `can_open(path)` says whether this process may connect to that unix socket."""
    if transport == "tcp":
        return tcp, "--transport tcp"
    if not ipc:
        return tcp, "the server offers no ipc endpoint"
    if server_host != my_host:
        return tcp, f"the server runs on host {server_host!r}, this process on {my_host!r}"
    path = ipc.removeprefix("ipc://")
    if not can_open(path):
        return tcp, f"same host, but this process cannot open {path} (another user's server, or another machine " \
                    "with the same hostname)"
    return ipc, "same host"


def can_open(path: str) -> bool:
    """A unix socket this process may connect to (write permission on it, search on its directory)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode) and os.access(path, os.W_OK)
    except OSError:
        return False


def endpoints(servers, local, transport: str) -> list[str]:
    """Each server's endpoint for this process, each choice logged. `servers`: the tcp
    endpoints; `local`: (hostname, ipc endpoint or "") per server, or none from a scheduler
    that sends none (both as the codec checked them: ClusterMap, Rewind)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    me = pysocket.gethostname()
    chosen = []
    for s, tcp in enumerate(servers):
        host, ipc = local[s] if local else ("", "")
        endpoint, why = choose(tcp, host, ipc, me, transport, can_open)
        log.info("server %d: connecting to %s (%s)", s, endpoint, why)
        chosen.append(endpoint)
    return chosen
