"""Transport security: CURVE key directories, the allow-list of client keys, the job
token, and the test for an address that anyone on the network can reach.

A key directory made by `keygen` holds two CURVE key pairs and an allow-list:

    server.key, server.key_secret   every socket that listens (scheduler, parameter servers)
    client.key, client.key_secret   every socket that connects (all roles)
    authorized/*.key                 the client public keys a listener admits

`keygen_client` adds a key for one machine: a directory holding only what a worker
needs (the server's public key and its own pair), whose public key joins the
allow-list; deleting that allow-list entry shuts the machine out at the next start.
"""

import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger("omnips.security")

SERVER, CLIENT, AUTHORIZED, CLIENTS = "server", "client", "authorized", "clients"
ZAP_DOMAIN = "omnips"
MAX_REPORTED_KEYS = 100  # refused keys logged once each, up to this many
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
EXPOSED_WARNING = ("listening on %s without --keys: anyone who can reach this port can join the job, read the "
                   "model and change it. Make keys with 'omnips keygen DIR' and start every process with "
                   "'--keys DIR', or bind loopback (--host 127.0.0.1)")


class KeysError(ValueError):
    """A key directory that cannot be made or used; the text says why in one line."""


# -- making keys ---------------------------------------------------------------------
def keygen(directory) -> list[Path]:
    """Write a new server pair, client pair and allow-list into `directory`; returns the files."""
    d = Path(directory)
    taken = [p.name for p in (d / f"{SERVER}.key", d / f"{SERVER}.key_secret", d / f"{CLIENT}.key",
                              d / f"{CLIENT}.key_secret", d / AUTHORIZED) if os.path.lexists(p)]  # a link too:
    # a dangling one would have the secret key written wherever it points
    if taken:
        raise KeysError(f"{d} already holds keys ({', '.join(taken)}): refusing to overwrite them")
    _private_dir(d)
    _private_dir(d / AUTHORIZED)
    files = [*_pair(d, SERVER), *_pair(d, CLIENT)]
    files.append(Path(shutil.copy(d / f"{CLIENT}.key", d / AUTHORIZED / f"{CLIENT}.key")))
    return files


def keygen_client(directory, name: str) -> Path:
    """Add a client key for one machine: `directory/clients/NAME/` (copy it to that
    machine and start it with --keys there) and `directory/authorized/NAME.key`."""
    d = Path(directory)
    if not _NAME.fullmatch(name) or name == CLIENT:
        raise KeysError(f"client name {name!r}: use letters, digits, '.', '_' or '-' (not {CLIENT!r})")
    if not (d / f"{SERVER}.key").is_file() or not (d / AUTHORIZED).is_dir():
        raise KeysError(f"{d} holds no job keys: make them first with 'omnips keygen {d}'")
    out, allowed = d / CLIENTS / name, d / AUTHORIZED / f"{name}.key"
    taken = next((p for p in (out, allowed) if os.path.lexists(p)), None)  # a link too, as in keygen
    if taken is not None:
        raise KeysError(f"client {name!r} exists already ({taken}): refusing to overwrite it")
    _private_dir(d / CLIENTS)
    _private_dir(out)
    _pair(out, CLIENT)
    shutil.copy(d / f"{SERVER}.key", out / f"{SERVER}.key")
    shutil.copy(out / f"{CLIENT}.key", allowed)
    return out


def _private_dir(d: Path) -> None:
    """Make `d` readable by its owner only, before any secret is written into it."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)
    except OSError as exc:
        raise KeysError(f"cannot make key directory {d}: {exc.strerror}") from None


def _pair(d: Path, name: str) -> list[Path]:
    public, secret = (Path(p) for p in zmq.auth.create_certificates(d, name))
    secret.chmod(0o600)
    return [public, secret]


# -- using keys ----------------------------------------------------------------------
@dataclass(frozen=True)
class Keys:
    """The keys one process uses; `server_secret` and `allowed` only where it listens."""

    path: Path
    server_public: bytes
    client_public: bytes
    client_secret: bytes = field(repr=False)
    server_secret: bytes | None = field(default=None, repr=False)
    allowed: frozenset = frozenset()  # z85 client public keys

    @classmethod
    def load(cls, directory, listens: bool) -> "Keys":
        """Read a key directory; `listens`: this process binds (scheduler, server)."""
        d = Path(directory)
        if not d.is_dir():
            raise KeysError(f"key directory {d} does not exist (make one with 'omnips keygen {d}')")
        server_public, _ = _read(d / f"{SERVER}.key", secret=False)
        client_public, client_secret = _read(d / f"{CLIENT}.key_secret", secret=True)
        if not listens:
            return cls(d, server_public, client_public, client_secret)
        if not (d / f"{SERVER}.key_secret").exists():
            raise KeysError(f"{d} holds no {SERVER}.key_secret: the scheduler and servers need the directory "
                            "made by 'omnips keygen', not a client's")
        _, server_secret = _read(d / f"{SERVER}.key_secret", secret=True)
        return cls(d, server_public, client_public, client_secret, server_secret, _allow_list(d / AUTHORIZED))

    def listen(self, sock: zmq.Socket) -> None:
        """Make `sock`, whose ZAP domain transport.bind has named, a CURVE server that admits
        only what the process's Gate allows."""
        if self.server_secret is None:
            raise KeysError(f"{self.path} holds no server secret key: this process cannot listen with it")
        sock.curve_secretkey = self.server_secret
        sock.curve_server = True
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler (gate stopped or missing): refuse all

    def connect(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of this job's listeners."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def _read(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"missing key file {path} (key directories are made by 'omnips keygen')")
    try:
        public, private = zmq.auth.load_certificate(path)
    except OSError as exc:
        raise KeysError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    except (ValueError, IndexError):  # (pyzmq's parser: a "public-key" line without "=")
        raise KeysError(f"{path} is not a CURVE key file") from None
    for key in (public, private) if secret else (public,):
        if key is None or not _is_key(key):
            raise KeysError(f"{path} holds no valid {'secret' if secret else 'public'} key")
    return public, private


def _is_key(key: bytes) -> bool:
    try:
        return len(key) == 40 and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError, struct.error):  # z85.decode's errors: alphabet, length, a value
        return False  # over 32 bits ("#" * 40)


def _allow_list(d: Path) -> frozenset:
    if not d.is_dir():
        raise KeysError(f"missing allow-list directory {d}: it holds the client keys that may join")
    keys = frozenset(_read(p, secret=False)[0] for p in sorted(d.glob("*.key")))
    if not keys:
        raise KeysError(f"the allow-list {d} holds no *.key file: no process could join")
    return keys


class Gate:
    """The ZAP handler of a process that listens: admits CURVE clients whose public key
    is on the allow-list. Start it before binding; stop it before destroying the context
    (the handler's thread owns sockets of that context)."""

    def __init__(self, ctx: zmq.Context, keys: Keys):
        self._allowed = keys.allowed
        self._reported: set[bytes] = set()
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("omnips.security.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, self)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the authenticator's thread for each CURVE handshake (z85 `key`)."""
        if key in self._allowed:
            return True
        if key not in self._reported and len(self._reported) < MAX_REPORTED_KEYS:
            self._reported.add(key)  # a refused client retries every 100 ms: one line per key
            log.warning("refused a connection: client key %s is not in the allow-list", key.decode())
        return False

    def stop(self) -> None:
        self._auth.stop()


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # socket monitor events of a refused connection


def handshake_failure(event: int, value: int, keys: Keys | None) -> str:
    """Why a listener refused this process's connection, from a socket monitor event. A
    listener that sees the other mechanism may close before this side reads why, so a
    bare close gets the advice for both causes."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH and keys is not None:
        return (f"it refused this process's client key {keys.client_public.decode()}: the key is not on its "
                f"allow-list ({AUTHORIZED}/)")
    mismatch = event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    if keys is None:
        return ("it uses --keys (CURVE): start this process with --keys too" if mismatch else
                "it closed the connection during the handshake: if it uses --keys, start this process with --keys too")
    return ("it does not use --keys" if mismatch else "it closed the connection during the CURVE handshake") + \
        ": start every process with keys from the same 'omnips keygen', or none"


def describe(keys: Keys | None) -> str:
    """How a listener's connections are protected, for its start-up log line."""
    if keys is None:
        return "plain TCP (no --keys)"
    return f"CURVE, admitting the {len(keys.allowed)} client key(s) in {keys.path / AUTHORIZED}"
