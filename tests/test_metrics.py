"""hvps.metrics: the exporter over real HTTP(S), and the metrics a real hvps process records.

The exporter tests run in this process (no hvps.init needed: serve() works before it); the
metric values come from tests/mpi/mpi_metrics.py in a one-rank hvps process (MPI singleton).
"""

import base64
import os
import select
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import SHARED_JOBS, case, run_mpi

from hvps import metrics
from hvps.core.errors import HvpsError
from hvps.metrics import server


def free_ports(count=1):
    """A base port such that ``count`` consecutive ports are free on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


@pytest.fixture
def exporter_cleanup():
    yield
    metrics.stop()


def get(url, auth=None, context=None, scheme="Basic", timeout=10):
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", f"{scheme} " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        return response.status, response.read().decode()


@pytest.mark.timeout(120)
def test_values_after_real_operations_in_a_singleton(tmp_path, monkeypatch):
    """init starts the exporter on 127.0.0.1:port+local_rank; collectives, optimizer steps,
    a checkpoint, a sharded table's cache, process and host readings are scraped with the expected values."""
    monkeypatch.delenv("HVPS_METRICS_ADDR", raising=False)
    result = run_mpi("mpi_metrics.py", 1, env={"HVPS_METRICS_PORT": str(free_ports()),
                                               "HVPS_TEST_SHARED_DIR": str(tmp_path)},
                     timeout=100, use_mpirun=False, extra_pytest_args=("-k", "not off_means"))
    result.assert_all_passed(min_passed=6)


@pytest.mark.timeout(120)
def test_off_means_no_server(tmp_path, monkeypatch):
    monkeypatch.delenv("HVPS_METRICS_PORT", raising=False)
    result = run_mpi("mpi_metrics.py", 1, env={"HVPS_TEST_SHARED_DIR": str(tmp_path)},
                     timeout=100, use_mpirun=False, extra_pytest_args=("-k", "off_means"))
    result.assert_all_passed(min_passed=1)


def test_binds_loopback_by_default(exporter_cleanup, monkeypatch):
    monkeypatch.delenv("HVPS_METRICS_ADDR", raising=False)
    exporter = metrics.serve(0)
    assert exporter.addr == "127.0.0.1"
    status, body = get(exporter.url)
    assert status == 200 and "hvps_info{" in body and "hvps_host_load1{" in body
    with pytest.raises(RuntimeError, match="already served"):
        metrics.serve(0)


def test_port_plus_local_rank_from_launcher_environment(exporter_cleanup, monkeypatch):
    """Before hvps.init the local rank comes from the launcher's variables (Open MPI's here)."""
    base = free_ports(4)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "7")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    exporter = metrics.serve(base)
    assert exporter.port == base + 3
    assert 'rank="7"' in get(exporter.url)[1]


def test_taken_port_is_an_error_naming_the_port(monkeypatch):
    """Metrics asked for on a port another socket holds (a squatter would get the scrapers'
    credentials): an HvpsError naming the port and what to do, from serve() and at init."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(HvpsError, match=rf"127\.0\.0\.1:{port}: port {port} is already taken.*TLS"):
            metrics.serve(port)
        assert metrics.current() is None
        monkeypatch.setenv("HVPS_METRICS_PORT", str(port))
        with pytest.raises(HvpsError, match=f"port {port} is already taken"):
            metrics.start_from_env()
    assert metrics.current() is None


def test_basic_auth_rejects_requests_without_credentials(exporter_cleanup, tmp_path, monkeypatch):
    secret = tmp_path / "auth"
    secret.write_text("scraper:s3cret:with:colons\n")
    monkeypatch.setenv("HVPS_METRICS_BASIC_AUTH_FILE", str(secret))
    exporter = metrics.serve(0)
    for auth in (None, ("scraper", "wrong"), ("other", "s3cret:with:colons")):
        with pytest.raises(urllib.error.HTTPError) as caught:
            get(exporter.url, auth)
        assert caught.value.code == 401
        assert "Basic" in caught.value.headers["WWW-Authenticate"]
    status, body = get(exporter.url, ("scraper", "s3cret:with:colons"))
    assert status == 200 and "hvps_info{" in body


def _self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line tool to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_with_a_self_signed_certificate(exporter_cleanup, tmp_path):
    cert, key = _self_signed(tmp_path)
    exporter = metrics.serve(0, certfile=str(cert), keyfile=str(key), basic_auth=("u", "p"))
    assert exporter.url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=str(cert))
    status, body = get(exporter.url, ("u", "p"), context=trusted)
    assert status == 200 and "hvps_info{" in body
    with pytest.raises(urllib.error.HTTPError) as caught:
        get(exporter.url, context=trusted)
    assert caught.value.code == 401
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        get(exporter.url, ("u", "p"), context=ssl.create_default_context())
    # Plain HTTP to the TLS port gets no metrics.
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        get(exporter.url.replace("https://", "http://"), ("u", "p"))
    # The server still answers afterwards (a failed handshake does not stop it).
    assert get(exporter.url, ("u", "p"), context=trusted)[0] == 200


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    return _self_signed(tmp_path_factory.mktemp("cert"))


@pytest.mark.parametrize("scheme", ["basic", "BASIC", "bAsIc"])
def test_basic_auth_scheme_is_case_insensitive_over_tls(exporter_cleanup, certificate, scheme):
    """RFC 7235 2.1: the auth scheme is case-insensitive; the credentials are not."""
    cert, key = certificate
    exporter = metrics.serve(0, certfile=str(cert), keyfile=str(key), basic_auth=("u", "p"))
    trusted = ssl.create_default_context(cafile=str(cert))
    status, body = get(exporter.url, ("u", "p"), context=trusted, scheme=scheme)
    assert status == 200 and "hvps_info{" in body
    for wrong in (("u", "P"), ("U", "p")):
        with pytest.raises(urllib.error.HTTPError) as caught:
            get(exporter.url, wrong, context=trusted, scheme=scheme)
        assert caught.value.code == 401


def _socket_inodes():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _server_side_sockets(port):
    """Connected TCP sockets of this process whose local port is ``port``: the server's ends.

    Only sockets open both before and after reading the tables count (open all along: an inode is
    never reused while open), so sockets the server closes and opens meanwhile are not counted twice.
    """
    before = _socket_inodes()
    rows = [line.split() for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6")
            for line in open(table).read().splitlines()[1:]]
    inodes = before & _socket_inodes()
    return sum(1 for fields in rows
               if fields[3] != "0A" and fields[9] in inodes and int(fields[1].rsplit(":", 1)[1], 16) == port)


def _serve(transport, certificate, **kwargs):
    """An exporter over ``transport`` (http, tls) and a client context for it."""
    if transport == "http":
        return metrics.serve(0, **kwargs), None
    cert, key = certificate
    return (metrics.serve(0, certfile=str(cert), keyfile=str(key), **kwargs),
            ssl.create_default_context(cafile=str(cert)))


@pytest.mark.parametrize("transport", ["http", "tls"])
def test_slow_loris_takes_bounded_sockets_and_threads(exporter_cleanup, certificate, transport):
    """300 connections that never finish their request (over TLS: never say hello) hold at most
    MAX_CONNECTIONS sockets and no thread of their own; a real scrape still gets through."""
    threads_before = threading.active_count()
    exporter, context = _serve(transport, certificate, basic_auth=("u", "p"))
    held = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", exporter.port))
            held.append(s)
        time.sleep(0.3)
        if transport == "http":
            for s in held:  # a request head that never ends
                try:
                    s.send(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                except OSError:
                    pass
        time.sleep(0.7)
        assert _server_side_sockets(exporter.port) <= server.MAX_CONNECTIONS
        assert threading.active_count() <= threads_before + 1 + server.WORKERS
        status, body = get(exporter.url, ("u", "p"), context=context, timeout=5)
        assert status == 200 and "hvps_info{" in body
        assert _server_side_sockets(exporter.port) <= server.MAX_CONNECTIONS
    finally:
        for s in held:
            s.close()


def _client_hello():
    """The first bytes of a TLS handshake, to send one at a time."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


@pytest.mark.parametrize("client", ["idle", "trickle"])
@pytest.mark.parametrize("transport", ["http", "tls"])
def test_deadline_closes_a_connection_that_never_completes(exporter_cleanup, certificate, monkeypatch,
                                                           transport, client):
    """One deadline from accept (here 0.5 s) covers the TLS handshake and the request head: a
    connection that sends nothing, or one byte every 0.1 s, is closed by then. Before, the limit
    was 10 s per read, so a trickle was kept forever."""
    monkeypatch.setattr(server, "REQUEST_DEADLINE", 0.5)
    exporter, _ = _serve(transport, certificate)
    payload = _client_hello() if transport == "tls" else b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 100
    closed = False
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as s:
        for i in range(40):  # 4 s at most
            try:
                if client == "trickle":
                    s.send(payload[i:i + 1])
                if select.select([s], [], [], 0.1)[0]:
                    closed = s.recv(4096) == b""
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
    assert closed, f"the server still held a {client} connection after 4 s (its deadline: 0.5 s)"
    # The server still serves. A loaded CI machine may take over this test's 0.5 s for a handshake and a
    # scrape: the honest scrape gets a deadline (read at accept) that only a hang passes.
    exporter.server.deadline = 120.0
    status, body = get(exporter.url, context=ssl.create_default_context(cafile=str(certificate[0]))
                       if transport == "tls" else None, timeout=120)
    assert status == 200 and "hvps_info{" in body


def test_a_pause_for_the_cpu_share_does_not_count_against_a_deadline(exporter_cleanup):
    """A connection open while the loop pauses for its CPU share (here: the share spent, 2 s to refill)
    keeps its deadline's serving time: the pause moves the deadline back, and the request, finished after
    the pause, is answered. Before, a lone honest scrape after a slow client could be closed unanswered."""
    exporter = metrics.serve(0)
    srv = exporter.server
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=60) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head, all but its last line
        conn = _wait_for(lambda: next(iter(list(srv._conns.values())), None))
        accepted_deadline = conn.deadline
        srv._budget.charge(server.CPU_BURST + 2 * server.CPU_SHARE)  # 2 s of the share's refill
        srv._wake()
        _wait_for(lambda: conn.deadline > accepted_deadline)
        _wait_for(lambda: srv._budget.wait_seconds() == 0)
        s.sendall(b"\r\n")
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.0 200 ") and b"hvps_info{" in reply, reply[:200]


def _wait_for(found, seconds=60.0):
    """``found()``'s first true value, polled for up to ``seconds`` (a guard against a hang)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = found()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"not found within {seconds} s")


def test_oversized_request_head_gets_431(exporter_cleanup):
    exporter = metrics.serve(0)
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=3) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * (server.MAX_REQUEST_BYTES + 100))
        assert s.recv(64).startswith(b"HTTP/1.0 431 ")
    assert get(exporter.url)[0] == 200


@pytest.mark.inner_cases(cases=lambda np_: [(np_, case("metrics_squat", "mpi_metrics_squat.py", timeout=90))],
                         share=SHARED_JOBS)
@pytest.mark.parametrize("np_", [2, 3], ids=["np2", "np3"])
def test_squatted_port_of_rank_1_is_an_error_there(np_, inner_results):
    """A local user who binds rank 1's port first: hvps.init raises on rank 1, naming the port
    (tests/mpi/mpi_metrics_squat.py); the other ranks serve on their own ports."""
    inner_results["metrics_squat"].assert_all_passed(min_passed=1)


@pytest.mark.unit
def test_hooks_are_no_ops_while_off():
    assert metrics.current() is None and metrics._sink is None
    metrics.record_samples(3)
    metrics.on_step()
    metrics.on_sync_start()
    metrics.on_sync_end(None)
    metrics.on_collective_error("hvps stall: x", True)

    @metrics.timed_checkpoint("save")
    def save():
        return "result"

    assert save() == "result"


@pytest.mark.unit
def test_engine_histograms_use_prometheus_le_buckets():
    from hvps.metrics.instruments import PlainHistogram

    h = PlainHistogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 3.0):
        h.observe(value)
    assert h.cumulative() == [("1.0", 2), ("2.0", 4), ("+Inf", 5)]
    assert h.sum == 8.0
