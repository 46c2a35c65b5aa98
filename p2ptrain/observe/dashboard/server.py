"""The dashboard's HTTP server: the page's static files and the swarm as JSON, read-only, standard library only.

The page (``static/``) polls ``api/swarm`` every 2 s. Every URL it uses is relative, so the whole dashboard can sit
behind a reverse proxy under a path prefix (``location /swarm/ { proxy_pass http://127.0.0.1:8080/; }``).
"""

from __future__ import annotations

import json
import logging
import math
import mimetypes
import re
import socket
import socketserver
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any, Callable, Optional, Tuple
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

STATIC_PACKAGE = __package__  # the page's files are the package's static/ folder, also inside an installed wheel
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
}
# A static name is one plain file name: no slash (raw or %2F), no "..", no leading dot, no percent escapes at all.
STATIC_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
ALLOWED_METHODS = "GET, HEAD"
# Peer ids and warning messages come from other peers: the page never puts them into the DOM as markup, and this
# policy is the second fence (no inline script, nothing loaded from anywhere but this server).
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
MAX_ERROR_CHARS = 300


def one_line(error: BaseException) -> str:
    """``TypeName: first line of the message``, short enough for the page's error bar and a log line."""
    message = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 1] + "…"


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None: ``json.dumps`` would write them as ``NaN``, which the
    browser's ``JSON.parse`` rejects, and one diverged peer's loss would blank the whole page."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def to_json(value: Any) -> bytes:
    try:
        text = json.dumps(value, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere: rare, so only then walk the whole object
        text = json.dumps(_finite(value), allow_nan=False)
    return text.encode()


def static_file(name: str) -> Optional[bytes]:
    """The bytes of ``static/<name>``, or None unless ``name`` is a plain file name of a file that is there."""
    if not STATIC_NAME.fullmatch(name):
        return None
    path = resources.files(STATIC_PACKAGE).joinpath("static").joinpath(name)
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a browser's request in flight never holds up close() or the interpreter's exit
    # Two dashboards on one port must be an error (OSError at start), never two listeners sharing it silently.
    allow_reuse_port = False

    def __init__(self, address: Tuple[str, int], dashboard: "DashboardServer"):
        self.dashboard = dashboard
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(host): a reverse-DNS lookup that stalls for seconds on a host
        # with no resolver. Nothing here uses the name.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address) -> None:
        # socketserver prints a traceback to stderr for any exception in a handler. A browser that closed its tab
        # mid-response is routine; anything else is a bug here, worth a warning, but never the end of the server.
        routine = isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError))
        (logger.debug if routine else logger.warning)(f"dashboard request from {client_address[0]} failed",
                                                      exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "p2ptrain-dashboard"
    protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads outlive close()

    def do_GET(self) -> None:
        self._respond(head=False)

    def do_HEAD(self) -> None:
        self._respond(head=True)

    def _method_not_allowed(self) -> None:
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"method not allowed: the dashboard is read-only\n",
                   "text/plain; charset=utf-8", head=False, extra={"Allow": ALLOWED_METHODS})

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = _method_not_allowed

    def _respond(self, head: bool) -> None:
        path = urlsplit(self.path).path
        dashboard = self.server.dashboard
        if path in ("/", "/index.html"):
            self._send_static("index.html", head)
        elif path.startswith("/static/"):
            self._send_static(path[len("/static/"):], head)
        elif path == "/api/swarm":
            self._send_api(dashboard.snapshot, "swarm", head)
        elif path == "/api/status" and dashboard.status is not None:
            self._send_api(dashboard.status, "status", head)
        elif path == "/healthz":
            self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8", head)
        else:
            self._not_found(head)

    def _not_found(self, head: bool) -> None:
        self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8", head)

    def _send_static(self, name: str, head: bool) -> None:
        body = static_file(name)
        if body is None:
            self._not_found(head)
            return
        suffix = name[name.rfind("."):] if "." in name else ""
        content_type = CONTENT_TYPES.get(suffix) or mimetypes.guess_type(name)[0] or "application/octet-stream"
        self._send(HTTPStatus.OK, body, content_type, head, extra={"Cache-Control": "no-cache"})

    def _send_api(self, read: Callable[[], dict], what: str, head: bool) -> None:
        try:
            body, status = to_json(read()), HTTPStatus.OK
            self.server.dashboard._note_success(what)
        except Exception as e:  # noqa: BLE001 - the DHT being unreachable is a state to show, not a crash
            message = one_line(e)
            self.server.dashboard._note_failure(what, message)
            body, status = to_json({"error": message}), HTTPStatus.SERVICE_UNAVAILABLE
        # X-Server-Time lets the page say "updated N s ago" against this host's clock, not the browser's
        self._send(status, body, "application/json", head,
                   extra={"Cache-Control": "no-store", "X-Server-Time": f"{time.time():.3f}"})

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, head: bool, extra: Optional[dict] = None):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in {**SECURITY_HEADERS, **(extra or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        # http.server writes every request to stderr; a dashboard polled every 2 s would flood the daemon's log
        logger.debug(f"dashboard {self.address_string()}: {format % args}")


class DashboardServer:
    """Serves the dashboard page and ``snapshot()`` as JSON over HTTP, in a daemon thread.

    ``snapshot`` returns the swarm as the dict that ``GET /api/swarm`` sends (called once per request, from the
    server's request threads, so possibly from several at once); ``status``, if given, is ``GET /api/status``.
    Either raising makes that request a 503 with ``{"error": "<one line>"}`` and a warning in the log (once per
    distinct error), and the server keeps going. Both are plain attributes read at each request, so a caller may bind
    the port first and set them once the swarm is joined.

    Use as ``with DashboardServer(read_swarm, port=0).start() as server: print(server.url)``.
    """

    def __init__(self, snapshot: Callable[[], dict], *, host: str = "127.0.0.1", port: int = 8080,
                 status: Optional[Callable[[], dict]] = None):
        self.snapshot, self.status = snapshot, status
        self.host, self.port = host, port
        self._httpd: Optional[_HTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self._errors_lock = threading.Lock()
        self._last_error: dict = {}  # what -> the last error message warned about, until a request succeeds

    def start(self) -> "DashboardServer":
        """Bind and serve in a daemon thread. A port in use raises ``OSError`` (errno EADDRINUSE) as it is."""
        if self._httpd is not None:
            raise RuntimeError("the dashboard server is already started")
        self._httpd = _HTTPServer((self.host, self.port), self)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs=dict(poll_interval=0.2),
                                        name=f"dashboard-http-{self.port}", daemon=True)
        self._thread.start()
        logger.debug(f"dashboard at {self.url}")  # the callers print the URL themselves
        return self

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        """Stop serving, free the port and join the server thread; safe to call twice or before ``start()``."""
        httpd, thread, self._httpd, self._thread = self._httpd, self._thread, None, None
        if httpd is None:
            return
        httpd.shutdown()  # returns once serve_forever has left its loop
        httpd.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> "DashboardServer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _note_failure(self, what: str, message: str) -> None:
        with self._errors_lock:
            repeated = self._last_error.get(what) == message
            self._last_error[what] = message
        # every open browser asks every 2 s: warn when the error changes, not 30 times a minute
        (logger.debug if repeated else logger.warning)(f"dashboard: cannot read the {what}: {message}")

    def _note_success(self, what: str) -> None:
        if what in self._last_error:
            with self._errors_lock:
                if self._last_error.pop(what, None) is not None:
                    logger.info(f"dashboard: reading the {what} works again")
