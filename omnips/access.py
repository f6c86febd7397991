"""Access checks that need no sockets: a token compared in constant time, and whether an
address faces the network. The scheduler's registry uses them without loading zmq."""

import hmac
import ipaddress


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison, so a refusal's timing tells nothing about the token."""
    return hmac.compare_digest(given.encode(), expected.encode())


def exposed(host: str) -> bool:
    """Whether a socket bound to `host` may be reached from other machines: true for
    every address that is not loopback (127.0.0.0/8, ::1, localhost), wildcards included."""
    host = host.strip().removeprefix("[").removesuffix("]").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host or interface name: it may face the network
        return True
