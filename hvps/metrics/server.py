"""The HTTP(S) endpoint: prometheus-client's WSGI app and threading server, plus basic auth.

prometheus-client's ``start_http_server`` takes a certificate and key for TLS but has no
server-side authentication (its ``basic_auth_handler`` is for pushing to a Pushgateway),
so this module serves the same ``make_wsgi_app`` through the same ``ThreadingWSGIServer``
behind a small basic-auth check. TLS is Python's ``ssl`` with TLS 1.2 as the minimum.
"""

from __future__ import annotations

import base64
import hmac
import socket
import ssl
import threading
from typing import Any, Callable, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

#: seconds a client may take to send its request (a stuck scraper does not hold a thread forever)
CLIENT_TIMEOUT = 10.0


class _QuietHandler(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


def read_basic_auth_file(path: str) -> Tuple[str, str]:
    """``(user, password)`` from the first line of ``path``, written as ``user:password``."""
    with open(path) as f:
        line = f.readline().rstrip("\r\n")
    user, sep, password = line.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"{path}: the first line must be user:password")
    return user, password


def require_basic_auth(app: Callable, user: str, password: str) -> Callable:
    """``app`` answering 401 unless the request carries these credentials."""
    expected = b"Basic " + base64.b64encode(f"{user}:{password}".encode())

    def guarded(environ: dict, start_response: Callable) -> list:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="hvps metrics"'),
                                            ("Content-Type", "text/plain; charset=utf-8")])
        return [b"401 Unauthorized: hvps metrics need basic auth credentials\n"]

    return guarded


def tls_context(certfile: str, keyfile: Optional[str]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certfile=certfile, keyfile=keyfile)
    return context


class MetricsServer:
    """Serves ``registry`` on ``addr:port`` in a daemon thread until ``close()``."""

    def __init__(self, registry: Any, addr: str, port: int, certfile: Optional[str] = None,
                 keyfile: Optional[str] = None, basic_auth: Optional[Tuple[str, str]] = None) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):
            address_family = family

            def handle_error(self, request: Any, client_address: Any) -> None:
                """A client that fails the TLS handshake or hangs up is not worth a traceback."""

        app = make_wsgi_app(registry)
        if basic_auth is not None:
            app = require_basic_auth(app, *basic_auth)
        self.httpd = Server(sockaddr[:2], _QuietHandler)
        self.httpd.set_app(app)
        self.tls = bool(certfile)
        if certfile:
            # The handshake runs on the first read, in the request's own thread, so a client
            # that connects and says nothing cannot block the accepting thread.
            self.httpd.socket = tls_context(certfile, keyfile).wrap_socket(
                self.httpd.socket, server_side=True, do_handshake_on_connect=False)
        self.addr, self.port = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hvps-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)
