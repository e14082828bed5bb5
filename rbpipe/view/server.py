"""``rbpipe view PATH``: the page and its JSON endpoints on the standard library's threading HTTP server.

Endpoints (all GET, JSON unless said): ``/`` the page; ``/plotly.min.js`` the plot library (from the installed
``plotly`` package, gzip-compressed when the browser accepts it, so nothing is fetched from the network);
``/api/state`` counts and the store's version (polled by the page to see new groups); ``/api/groups?where=&
offset=&limit=&upto=`` one page of groups; ``/api/group?seq=`` one group's members; ``/api/plot?where=`` the
reward and advantage spread per policy version. A bad filter is a 400 answer ``{"error": "<one line>"}``
that the page shows above the table.
"""

from __future__ import annotations

import errno
import gzip
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rbpipe.errors import ConfigError, RbpipeError
from rbpipe.view.page import plotly_js, render_page
from rbpipe.view.source import StoreView


class _Handler(BaseHTTPRequestHandler):
    """Routes GET requests to the :class:`StoreView` of the server; nothing else is served."""

    server: ViewServer

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        url = urlsplit(self.path)
        q = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        view = self.server.view
        try:
            if url.path in ("/", "/index.html"):
                self._send(200, self.server.page, "text/html; charset=utf-8")
            elif url.path == "/plotly.min.js":
                self._send_js()
            elif url.path == "/api/state":
                self._json(200, view.state())
            elif url.path == "/api/groups":
                self._json(200, view.page(q.get("where"), _int(q, "offset", 0), min(_int(q, "limit", 100), 1000),
                                          _int(q, "upto", -1)))
            elif url.path == "/api/group":
                self._json(200, view.group(_int(q, "seq", -1)))
            elif url.path == "/api/plot":
                self._json(200, view.plot(q.get("where")))
            else:
                self._json(404, {"error": f"no such page {url.path!r}"})
        except RbpipeError as err:
            self._json(400, {"error": str(err)})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the browser went away (a reload while a page was being sent)

    def _json(self, status: int, doc: Any) -> None:
        self._send(status, json.dumps(doc, allow_nan=False, default=str).encode(), "application/json")

    def _send_js(self) -> None:
        body, zipped = self.server.plotly, "gzip" in self.headers.get("Accept-Encoding", "")
        self.send_response(200)
        self.send_header("Content-Type", "text/javascript; charset=utf-8")
        self.send_header("Cache-Control", "max-age=86400")
        if zipped:
            self.send_header("Content-Encoding", "gzip")
        data = self.server.plotly_gz() if zipped else body
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the standard library's name)
        """Quiet: a page polls every second or two, and a line per request would bury the output."""


def _int(q: dict[str, str], name: str, default: int) -> int:
    try:
        return int(q.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {q[name]!r}") from None


class ViewServer(ThreadingHTTPServer):
    """The standard library's threading HTTP server holding one :class:`StoreView`.

    Examples:
        >>> from rbpipe.view.server import ViewServer
        >>> server = ViewServer(("127.0.0.1", 0), StoreView("runs/demo/store"))   # doctest: +SKIP
        >>> server.serve_forever()                                                # doctest: +SKIP
    """

    daemon_threads = True  # a browser's open connection never keeps Ctrl-C from ending the server

    def __init__(self, address: tuple[str, int], view: StoreView) -> None:
        self.view = view
        self.page = render_page(view.store, static=None).encode()
        self.plotly = plotly_js().encode()
        self._gz: bytes | None = None
        self._gz_lock = threading.Lock()
        try:
            super().__init__(address, _Handler)
        except OSError as exc:
            host, port = address
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"port {port} on {host} is in use (another rbpipe view?): pass another --port, "
                                  "or --port 0 for a free one") from None
            if isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise ConfigError(f"--host {host} is not an address of this machine ({exc.strerror}): pass "
                                  "127.0.0.1 (the default) or one of its interfaces") from None
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): pass another --host or "
                              "--port") from None

    def plotly_gz(self) -> bytes:
        with self._gz_lock:
            if self._gz is None:
                self._gz = gzip.compress(self.plotly, 6)
            return self._gz

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"
