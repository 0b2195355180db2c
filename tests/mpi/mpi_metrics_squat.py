"""Inner test (2 and 3 ranks, run by tests/test_metrics.py): a local user binds rank 1's metrics
port before the job does. Whoever holds it would receive Prometheus's requests, basic-auth
credentials included, so ``hvps.init`` raises an HvpsError on rank 1 naming the port (not a log
line); the other ranks serve on their own ports as usual.
"""

import socket

import pytest

import hvps
from hvps import metrics

pytestmark = pytest.mark.timeout(60)


def _free_base(count):
    """A base port with ``count`` consecutive free ports on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def test_squatted_port_of_rank_1_is_an_error_on_rank_1(monkeypatch):
    monkeypatch.delenv("HVPS_METRICS_PORT", raising=False)
    monkeypatch.delenv("HVPS_METRICS_ADDR", raising=False)
    hvps.init()  # without metrics: only to agree on a base port
    rank, local_rank, size = hvps.rank(), hvps.local_rank(), hvps.size()
    base = hvps.broadcast_object(_free_base(size) if rank == 0 else None, root_rank=0, name="squat.base")
    hvps.shutdown()

    monkeypatch.setenv("HVPS_METRICS_PORT", str(base))
    squatter = None
    if rank == 1:  # another socket takes rank 1's port (base + local rank) first
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", base + local_rank))
        squatter.listen()
    try:
        if squatter is not None:
            with pytest.raises(hvps.HvpsError, match=rf"rank 1 cannot listen on 127\.0\.0\.1:{base + local_rank}: "
                                                     rf"port {base + local_rank} \(HVPS_METRICS_PORT={base} \+ "
                                                     rf"local rank {local_rank}\) is already taken"):
                hvps.init()
            assert metrics.current() is None
        else:
            hvps.init()
            assert metrics.current() is not None and metrics.current().port == base + local_rank
        hvps.barrier()  # every rank's engine is up: the job can still end in order
    finally:
        metrics.stop()
        if squatter is not None:
            squatter.close()
