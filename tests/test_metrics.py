"""hvps.metrics: the exporter over real HTTP(S), and the metrics a real hvps process records.

The exporter tests run in this process (no hvps.init needed: serve() works before it); the
metric values come from tests/mpi/mpi_metrics.py in a one-rank hvps process (MPI singleton).
"""

import base64
import logging
import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request

import pytest
from conftest import run_mpi

from hvps import metrics


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


def get(url, auth=None, context=None):
    request = urllib.request.Request(url)
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
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


def test_taken_port_is_logged_not_raised(monkeypatch, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("HVPS_METRICS_PORT", str(taken.getsockname()[1]))
        with caplog.at_level(logging.ERROR, logger="hvps"):
            assert metrics.start_from_env() is None
    assert "metrics are off on this rank" in caplog.text
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
