"""The scheduler's status server: GET / (a page), /status.json and /metrics (Prometheus).

stdlib http.server on a thread of its own. The scheduler's loop feeds every event it
writes to a StatusBook (omnips.status) and now and then publishes a snapshot: a new
dict swapped in whole, which the server's threads only read. A request never takes a
lock the loop waits for, so no client, however slow, can stall the job.
"""

import argparse
import ipaddress
import json
import logging
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from omnips import access
from omnips.flags import port
from omnips.metrics import finite, read_events
from omnips.status import StatusBook

from . import status_metrics

log = logging.getLogger("omnips.scheduler")

PUBLISH_EVERY_S = 0.5  # the newest snapshot is at most this old (plus a loop turn)
REQUEST_TIMEOUT_S = 10.0  # a client that sends nothing for this long loses its connection
PAGE = Path(__file__).with_name("status_page.html")
EXPOSED_WARNING = ("status server on %s without --token: anyone who can reach this port can read the job's "
                   "progress, its hosts and its plan. Give the job a --token (or $OMNIPS_TOKEN), or bind loopback "
                   "(--status-host 127.0.0.1)")


def status_port(text: str) -> int | None:
    """--status-port: a port (0: any free one), or 'off' for no status server (None)."""
    if text.strip().lower() == "off":
        return None
    try:
        return port(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'off'") from None


def authorized(token: str, authorization: str | None, query: str) -> bool:
    """Whether a request may read the status: no job token, or the token given as
    'Authorization: Bearer TOKEN' or '?token=TOKEN' (what a browser can carry)."""
    if not token:
        return True
    given = ""
    if authorization and authorization.startswith("Bearer "):
        given = authorization.removeprefix("Bearer ").strip()
    else:
        given = parse_qs(query).get("token", [""])[0]
    return access.token_matches(given, token)


def route(path: str, page: bytes, render) -> tuple[int, str, bytes]:
    """(status code, content type, body) for GET `path`; `render(kind)` makes the JSON or the
    Prometheus text of the newest snapshot."""
    if path == "/":
        return 200, "text/html; charset=utf-8", page
    if path == "/status.json":
        return 200, "application/json", render("json")
    if path == "/metrics":
        return 200, status_metrics.CONTENT_TYPE, render("metrics")
    return 404, "text/plain; charset=utf-8", f"no such page: {path} (try /, /status.json or /metrics)\n".encode()


def render(snap: dict, kind: str) -> bytes:
    if kind == "json":
        return json.dumps(finite(snap), allow_nan=False).encode()
    return status_metrics.exposition(status_metrics.registry(lambda: snap))


class Rendered:
    """The bodies of the newest snapshot, each made once (not once a request): however often
    clients ask, the server's threads take the GIL from the loop about twice a second."""

    def __init__(self, snapshot):
        self.snapshot = snapshot
        self._lock = threading.Lock()  # among the server's threads only; the loop never takes it
        self._snap, self._bodies = None, {}

    def __call__(self, kind: str) -> bytes:
        with self._lock:
            snap = self.snapshot()
            if snap is not self._snap:
                self._snap, self._bodies = snap, {}
            if kind not in self._bodies:
                self._bodies[kind] = render(snap, kind)
            return self._bodies[kind]


def listen_address(host: str, port_: int) -> tuple[int, tuple]:
    """(address family, socket address) to bind for `host`, an IPv4 or IPv6 address or a
    host name (its first address); OSError when a name does not resolve."""
    family, _, _, _, address = socket.getaddrinfo(host, port_, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, address


class HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer in the family of its address. The IPv6 wildcard `::` takes IPv4
    clients too (IPV6_V6ONLY off), as 0.0.0.0 would: one flag exposes the page on both."""

    daemon_threads = True

    def __init__(self, family: int, address: tuple, handler):
        self.address_family = family
        super().__init__(address, handler)

    def server_bind(self):
        if self.address_family == socket.AF_INET6 and ipaddress.ip_address(self.server_address[0]).is_unspecified:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # (not HTTPServer's: it asks a name server for the host's full name, which may hang)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


def host_port(host: str, port_: int) -> str:
    """host:port as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port_}" if ":" in host else f"{host}:{port_}"


class StatusServer:
    """The HTTP driver: binds at once (an error names the address), serves from a thread."""

    def __init__(self, host: str, port_: int, token: str, snapshot):
        page = PAGE.read_bytes()
        bodies = Rendered(snapshot)

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self):
                url = urlsplit(self.path)
                if not authorized(token, self.headers.get("Authorization"), url.query):
                    self._send(401, "text/plain; charset=utf-8", b"this job's status needs its token: "
                               b"'Authorization: Bearer TOKEN' or ?token=TOKEN\n", {"WWW-Authenticate": "Bearer"})
                    return
                self._send(*route(url.path, page, bodies))

            def _send(self, code: int, kind: str, body: bytes, headers=None):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):  # not to stderr: the scheduler's log stays the job's
                log.debug("status server: " + fmt, *args)

        try:
            self.httpd = HTTPServer(*listen_address(host, port_), Handler)
        except OSError as exc:
            raise OSError(f"scheduler: cannot bind the status server to {host_port(host, port_)}: "
                          f"{exc.strerror or exc}") from None
        self.url = f"http://{host_port(host, self.httpd.server_address[1])}/"
        if access.exposed(host) and not token:
            log.warning(EXPOSED_WARNING, self.url)
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="status-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)


class StatusPublisher:
    """What the scheduler's loop holds: feeds the book, publishes its snapshot now and then."""

    url: str | None

    def __init__(self, job: dict, run_dir: str, host: str, port_: int, token: str):
        self.book = StatusBook(job, run_dir)
        self.snapshot = self.book.snapshot()
        self._published, self._next = 0, 0.0  # events in the published snapshot; when the next may be
        self.server = StatusServer(host, port_, token, lambda: self.snapshot)
        self.url = self.server.url

    def attach(self, run, resumed: bool = False) -> None:
        """Take every event `run` (a RunDir) writes from now on, after those its metrics.jsonl
        holds when `resumed`; the book's times become Unix times from run's clock."""
        if resumed:
            try:
                for e in read_events(run.path):
                    self.book.add(e)
            except (ValueError, OSError) as exc:  # the page is no reason to refuse a resume
                log.warning("scheduler: the status page shows no events from before the resume: %s", exc)
        self.book.unix_t0 = time.time() - (run.clock() - run.t0)
        run.watchers.append(self.book)  # one call per report

    def add(self, record: dict) -> None:
        self.book.add(record)

    def tick(self, now: float) -> None:
        """Once a loop turn: publish when something changed and the last is old enough."""
        if now >= self._next and self.book.events_total != self._published:
            self.publish(now)

    def publish(self, now: float) -> None:
        self.snapshot = self.book.snapshot()  # one reference swapped: readers see the old or the new whole
        self._published, self._next = self.book.events_total, now + PUBLISH_EVERY_S

    def announce(self, say) -> None:
        say(f"omnips status page on {self.url}", flush=True)

    def close(self) -> None:
        self.server.close()


class NoStatus:
    """--status-port off: the same calls, doing nothing."""

    url = None

    def attach(self, run, resumed: bool = False) -> None:
        pass

    def tick(self, now: float) -> None:
        pass

    def publish(self, now: float) -> None:
        pass

    def announce(self, say) -> None:
        pass

    def close(self) -> None:
        pass


def open_status(job: dict, run_dir: str, host: str, port_: int | None, token: str):
    """The scheduler's status server, or NoStatus when `port_` is None (--status-port off)."""
    if port_ is None:
        return NoStatus()
    return StatusPublisher(job, run_dir, host, port_, token)
