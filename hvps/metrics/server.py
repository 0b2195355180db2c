"""The HTTP(S) endpoint: prometheus-client's WSGI app behind basic auth, served with fixed bounds.

The endpoint lives inside the training process, so whoever can reach its port must not be able
to take that process's threads, file descriptors or CPU. One thread (``hvps-metrics``) runs a
``selectors`` loop that accepts connections, does the TLS handshake and reads each request's
head, all non-blocking; a small pool (:data:`WORKERS` threads) turns a complete request into a
response with the standard library's ``wsgiref`` handler and prometheus-client's
``make_wsgi_app``; the loop writes it back and closes the connection (one request each). Bounds:

- at most :data:`MAX_CONNECTIONS` client sockets are open. When they are all taken, a new
  connection replaces the oldest one that has not finished sending its request; when every
  one has (a flood of real requests), the server stops accepting until one is answered, and
  new connections wait in the kernel's listen queue (:data:`BACKLOG`);
- every connection has one deadline, :data:`REQUEST_DEADLINE` seconds from ``accept``, for
  its TLS handshake, its request and the response; then it is closed, however it trickles. The
  loop's pauses for its CPU share (below) are the server's, not the client's: they move every
  open connection's deadline back by their length, so that a lone scrape after a flood is served;
- a request's head may hold :data:`MAX_REQUEST_BYTES` (431 beyond); a body is not read;
- the loop and the workers together use at most :data:`CPU_SHARE` of one core on average
  (bursts up to :data:`CPU_BURST` CPU-seconds): past that the loop pauses, so a flood of
  clients slows the scrapes, not the training.

Basic auth is checked before the app runs (the scheme case-insensitively, RFC 7235; the
credentials with ``hmac.compare_digest``). TLS is Python's ``ssl`` with TLS 1.2 as the minimum.
"""

from __future__ import annotations

import base64
import binascii
import collections
import errno
import hmac
import io
import logging
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import make_wsgi_app

#: threads that build responses (the metrics text); the loop thread does all the socket work
WORKERS = 4
#: client sockets open at once, at most
MAX_CONNECTIONS = 128
#: the kernel's queue of connections not yet accepted
BACKLOG = min(128, socket.SOMAXCONN)
#: seconds from accept to the end of the response: TLS handshake, request head and reply
REQUEST_DEADLINE = 5.0
#: bytes of a request's head (request line and headers), at most
MAX_REQUEST_BYTES = 8192
#: average share of one core that serving may use, and the burst (CPU-seconds) it may spend at once
CPU_SHARE, CPU_BURST = 0.05, 0.1

_HANDSHAKE, _HEAD, _QUEUED, _WORKING, _WRITING = range(5)
log = logging.getLogger("hvps")


def _plain_response(status: str, text: str) -> bytes:
    body = text.encode()
    return (f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


_TOO_LARGE = _plain_response("431 Request Header Fields Too Large",
                             f"431: the request head is over {MAX_REQUEST_BYTES} bytes\n")
_FAILED = _plain_response("500 Internal Server Error", "500: building the metrics failed\n")


def read_basic_auth_file(path: str) -> Tuple[str, str]:
    """``(user, password)`` from the first line of ``path``, written as ``user:password``."""
    with open(path) as f:
        line = f.readline().rstrip("\r\n")
    user, sep, password = line.partition(":")
    if not sep or not user or not password:
        raise ValueError(f"{path}: the first line must be user:password")
    return user, password


def require_basic_auth(app: Callable, user: str, password: str) -> Callable:
    """``app`` answering 401 unless the request carries these credentials.

    The scheme is compared case-insensitively (``Basic``, ``basic``, ``BASIC``: RFC 7235 2.1);
    the decoded ``user:password`` must equal the expected bytes (``hmac.compare_digest``).
    """
    expected = f"{user}:{password}".encode()

    def authorized(header: str) -> bool:
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            return False
        return hmac.compare_digest(given, expected)

    def guarded(environ: dict, start_response: Callable) -> list:
        if authorized(environ.get("HTTP_AUTHORIZATION", "")):
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


class _Handler(WSGIRequestHandler):
    """wsgiref's request handler over bytes already read: parses the head, runs the app."""

    def __init__(self, head: bytes, client_address: Any, server: Any) -> None:
        self._head = head
        super().__init__(None, client_address, server)

    def setup(self) -> None:
        self.connection = None
        self.rfile = io.BytesIO(self._head)
        self.wfile = io.BytesIO()

    def finish(self) -> None:
        """Keep ``wfile``: the loop sends its bytes."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Scrapes are not logged."""


class _Site:
    """What wsgiref's handler asks of its server: the base environment and the app."""

    def __init__(self, app: Callable, name: str, port: int) -> None:
        self.app = app
        self.base_environ = {"SERVER_NAME": name, "GATEWAY_INTERFACE": "CGI/1.1", "SERVER_PORT": str(port),
                             "REMOTE_HOST": "", "CONTENT_LENGTH": "", "SCRIPT_NAME": ""}

    def get_app(self) -> Callable:
        return self.app

    def respond(self, head: bytes, client_address: Any) -> bytes:
        return _Handler(head, client_address, self).wfile.getvalue()


class _CpuBudget:
    """A token bucket of CPU-seconds: ``share`` per second, at most ``burst`` saved up."""

    def __init__(self, share: float, burst: float) -> None:
        self.share, self.burst = share, burst
        self._tokens, self._at = burst, time.monotonic()
        self._lock = threading.Lock()

    def charge(self, seconds: float) -> None:
        with self._lock:
            self._tokens -= seconds

    def wait_seconds(self) -> float:
        """How long serving must pause to be back within its share (0: go on)."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.share)
            self._at = now
            return -self._tokens / self.share if self._tokens < 0 else 0.0


class _Conn:
    __slots__ = ("sock", "address", "accepted", "deadline", "state", "data", "sent")

    def __init__(self, sock: socket.socket, address: Any, now: float, state: int, deadline: float) -> None:
        self.sock: Optional[socket.socket] = sock
        self.address, self.accepted, self.deadline, self.state = address, now, now + deadline, state
        self.data, self.sent = b"", 0


class BindFailed(OSError):
    """The listening socket could not be bound (``errno`` as the OS said: EADDRINUSE for a taken port)."""


class MetricsServer:
    """Serves ``registry`` on ``addr:port`` from a daemon thread until ``close()``.

    Binding happens here, in the caller's thread: a taken port raises :class:`BindFailed`
    (errno EADDRINUSE); an unreadable certificate or key raises ``OSError``/``ssl.SSLError``.
    """

    def __init__(self, registry: Any, addr: str, port: int, certfile: Optional[str] = None,
                 keyfile: Optional[str] = None, basic_auth: Optional[Tuple[str, str]] = None) -> None:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self.max_connections, self.deadline = MAX_CONNECTIONS, REQUEST_DEADLINE
        self._context = tls_context(certfile, keyfile) if certfile else None
        self.tls = self._context is not None
        app = make_wsgi_app(registry)
        if basic_auth is not None:
            app = require_basic_auth(app, *basic_auth)

        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            # SO_REUSEADDR lets a restarted job bind while old connections sit in TIME_WAIT; on
            # Linux it does not let two sockets listen on one port (SO_REUSEPORT would, and is not set).
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr[:2])
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise BindFailed(exc.errno, exc.strerror) from exc
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.addr, self.port = listener.getsockname()[:2]
        self._site = _Site(app, self.addr, self.port)  # no getfqdn: a reverse DNS lookup may hang
        self._budget = _CpuBudget(CPU_SHARE, CPU_BURST)
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="hvps-metrics-worker")
        self._conns: Dict[int, _Conn] = {}
        self._queue: Deque[_Conn] = collections.deque()
        self._done: Deque[Tuple[_Conn, Future]] = collections.deque()
        self._working = 0
        self._selector = selectors.DefaultSelector()
        self._waker, self._wake_in = socket.socketpair()
        for s in (self._waker, self._wake_in):
            s.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ)
        self._selector.register(listener, selectors.EVENT_READ)
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvps-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the loop thread ----------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._waker.send(b"\0")
        except OSError:  # the buffer is full (a wake-up is pending anyway) or the server is closed
            pass

    def _run(self) -> None:
        cpu = time.thread_time()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._expire(now)
                spent, cpu = time.thread_time() - cpu, time.thread_time()
                self._budget.charge(spent)
                pause = self._budget.wait_seconds()
                if pause > 0:  # over its CPU share: let the training have the core
                    self._stop.wait(min(pause, 0.1))
                    self._postpone_deadlines(time.monotonic() - now)
                    continue
                self._finish_responses()
                self._dispatch()
                self._set_accepting()
                for key, events in self._selector.select(self._timeout(now)):
                    if key.fileobj is self._listener:
                        self._accept(time.monotonic())
                    elif key.fileobj is self._wake_in:
                        self._drain_wakeups()
                    else:
                        self._step(key.data, events)
        except Exception:  # noqa: BLE001 - said once, loudly: the rank's metrics are gone
            log.exception("hvps metrics: the server at %s stopped", self.url)
        finally:
            self._close_all()

    def _timeout(self, now: float) -> float:
        if self._done:
            return 0.0
        soonest = min((c.deadline for c in self._conns.values()), default=now + 1.0)
        return max(0.0, min(soonest - now, 1.0))

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_in.recv(4096):
                pass
        except OSError:
            pass

    def _set_accepting(self) -> None:
        """Listen while there is room, or a connection that a newcomer may replace."""
        want = len(self._conns) < self.max_connections or any(
            c.state in (_HANDSHAKE, _HEAD) for c in self._conns.values())
        if want != self._accepting:
            if want:
                self._selector.register(self._listener, selectors.EVENT_READ)
            else:
                self._selector.unregister(self._listener)
            self._accepting = want

    def _accept(self, now: float) -> None:
        for _ in range(16):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNABORTED, or out of descriptors: try again on the next round
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._stop.wait(0.05)
                return
            if len(self._conns) >= self.max_connections and not self._evict_oldest():
                sock.close()  # every slot holds a complete request: refused
                return
            sock.setblocking(False)
            state = _HEAD
            if self._context is not None:
                try:
                    sock = self._context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError):
                    sock.close()
                    continue
                state = _HANDSHAKE
            conn = _Conn(sock, address, now, state, self.deadline)
            self._conns[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _evict_oldest(self) -> bool:
        """Close the oldest connection still sending its request; False when there is none."""
        waiting = [c for c in self._conns.values() if c.state in (_HANDSHAKE, _HEAD)]
        if not waiting:
            return False
        self._drop(min(waiting, key=lambda c: c.accepted))
        return True

    def _postpone_deadlines(self, seconds: float) -> None:
        """The loop paused ``seconds`` for its CPU share: no connection's deadline counts them."""
        for conn in self._conns.values():
            conn.deadline += seconds

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            self._drop(conn)

    def _step(self, conn: _Conn, events: int) -> None:
        if conn.sock is None:
            return
        if conn.state == _HANDSHAKE:
            self._handshake(conn)
        elif conn.state == _HEAD:
            self._read(conn)
        elif conn.state == _WRITING:
            self._write(conn)

    def _watch(self, conn: _Conn, events: int) -> None:
        key = self._selector.get_key(conn.sock)
        if key.events != events:
            self._selector.modify(conn.sock, events, conn)

    def _handshake(self, conn: _Conn) -> None:
        try:
            conn.sock.do_handshake()  # type: ignore[union-attr]
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except (OSError, ValueError):  # not TLS, a bad hello, a reset: nothing worth a log line
            self._drop(conn)
            return
        conn.state = _HEAD
        self._watch(conn, selectors.EVENT_READ)
        self._read(conn)

    def _read(self, conn: _Conn) -> None:
        sock = conn.sock
        while True:
            try:
                chunk = sock.recv(MAX_REQUEST_BYTES + 1)  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except (OSError, ValueError):
                self._drop(conn)
                return
            if not chunk:
                self._drop(conn)
                return
            start = max(0, len(conn.data) - 3)
            conn.data += chunk
            if b"\r\n\r\n" in conn.data[start:] or b"\n\n" in conn.data[max(0, start + 2):]:
                conn.state = _QUEUED
                self._selector.unregister(sock)
                self._queue.append(conn)
                return
            if len(conn.data) > MAX_REQUEST_BYTES:
                self._reply(conn, _TOO_LARGE)
                return
            if not isinstance(sock, ssl.SSLSocket) or not sock.pending():
                return

    def _dispatch(self) -> None:
        while self._queue and self._working < WORKERS:
            conn = self._queue.popleft()
            if conn.sock is None:
                continue
            conn.state = _WORKING
            self._working += 1
            future = self._pool.submit(self._respond, conn.data, conn.address)
            future.add_done_callback(lambda f, c=conn: self._response_ready(c, f))

    def _respond(self, head: bytes, address: Any) -> bytes:
        """In a worker: the response to one request head (its CPU time counts against the share)."""
        cpu = time.thread_time()
        try:
            return self._site.respond(head, address)
        finally:
            self._budget.charge(time.thread_time() - cpu)

    def _response_ready(self, conn: _Conn, future: Future) -> None:
        self._done.append((conn, future))
        self._wake()

    def _finish_responses(self) -> None:
        while self._done:
            conn, future = self._done.popleft()
            self._working -= 1
            if conn.sock is None or future.cancelled():
                continue
            try:
                response = future.result()
            except Exception:  # noqa: BLE001 - one failed scrape must not stop the server
                log.exception("hvps metrics: building a response failed")
                response = _FAILED
            self._reply(conn, response or _FAILED)

    def _reply(self, conn: _Conn, response: bytes) -> None:
        conn.data, conn.sent, conn.state = response, 0, _WRITING
        if self._selector.get_map().get(conn.sock) is None:  # type: ignore[arg-type]
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        else:
            self._watch(conn, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        while conn.sent < len(conn.data):
            try:
                # the same slice again after a would-block, as OpenSSL wants for a retried write
                conn.sent += conn.sock.send(conn.data[conn.sent:conn.sent + 65536])  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                return
            except ssl.SSLWantReadError:
                self._watch(conn, selectors.EVENT_READ)
                return
            except (OSError, ValueError):
                break
        self._drop(conn, graceful=True)

    def _drop(self, conn: _Conn, graceful: bool = False) -> None:
        sock, conn.sock = conn.sock, None
        if sock is None:
            return
        self._conns.pop(sock.fileno(), None)
        if self._selector.get_map().get(sock) is not None:  # type: ignore[arg-type]
            self._selector.unregister(sock)
        try:
            if graceful:
                try:  # what the client sent beyond the head would turn the close into a reset
                    sock.recv(65536)
                except (OSError, ValueError):
                    pass
                if isinstance(sock, ssl.SSLSocket):
                    try:
                        sock.unwrap()  # close_notify; the peer's answer is not awaited
                    except (OSError, ValueError):
                        pass
            sock.close()
        except OSError:
            pass

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._queue.clear()
        self._selector.close()
        for s in (self._listener, self._waker, self._wake_in):
            s.close()
