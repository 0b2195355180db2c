"""Inner tests of hvps.metrics in one process (MPI singleton), run by tests/test_metrics.py.

``-k served``: HVPS_METRICS_PORT is set, so hvps.init() starts the exporter; real collectives,
optimizer steps and a checkpoint then show up in a real scrape. ``-k off``: no HVPS_METRICS_PORT,
so no server, no prometheus_client import, and the hooks do nothing.
"""

import os
import sys
import threading
import urllib.request

import numpy as np
import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps import metrics

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def scrape(url=None):
    """{(name, frozenset(labels)): value} from a real HTTP scrape of the exporter."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url or metrics.current().url, timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels):
    want = {k: str(v) for k, v in labels.items()}
    found = [v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items()]
    assert found, f"no sample {name}{want}"
    return sum(found)


def _listening_ports():
    """TCP ports this process listens on, from /proc (sockets whose inode is one of our fds)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_served_at_init_on_loopback_port_plus_local_rank():
    exporter = metrics.current()
    assert exporter is not None, "HVPS_METRICS_PORT is set: hvps.init() must start the exporter"
    assert exporter.addr == "127.0.0.1"
    assert exporter.port == int(os.environ["HVPS_METRICS_PORT"]) + hvps.local_rank()
    assert exporter.port in _listening_ports()
    samples = scrape()
    assert value(samples, "hvps_info", rank=0, local_rank=0, version=hvps.__version__) == 1


def test_collectives_counted_by_op_with_bytes_and_latency():
    before = scrape()
    x = np.arange(1000, dtype=np.float32)
    hvps.allreduce(x, name="m.ar")
    hvps.allgather(np.ones((3, 5), dtype=np.float64), name="m.ag")
    hvps.broadcast(np.ones(7, dtype=np.int32), root_rank=0, name="m.bc")
    hvps.alltoall(np.ones(4, dtype=np.float32), name="m.a2a")
    hvps.reducescatter(np.ones(6, dtype=np.float32), name="m.rs")
    hvps.grouped_allreduce([np.ones(10, np.float32), np.ones(20, np.float32)], name="m.gar")
    after = scrape()

    def delta(name, **labels):
        return value(after, name, **labels) - (value(before, name, **labels) if any(
            n == name and {k: str(v) for k, v in labels.items()}.items() <= dict(ls).items()
            for n, ls in before) else 0.0)

    # allreduce: m.ar (one response) and the grouped pair (one fused response of two tensors)
    assert delta("hvps_collectives_total", op="allreduce") == 2
    assert delta("hvps_collective_tensors_total", op="allreduce") == 3
    assert delta("hvps_collective_bytes_total", op="allreduce") == 4000 + 120
    assert delta("hvps_collective_seconds_count", op="allreduce") == 2
    assert delta("hvps_collective_bytes_total", op="allgather") == 3 * 5 * 8
    assert delta("hvps_collective_bytes_total", op="broadcast") == 7 * 4
    assert delta("hvps_collective_bytes_total", op="alltoall") == 16
    assert delta("hvps_collective_bytes_total", op="reducescatter") == 24
    for op in ("allgather", "broadcast", "alltoall", "reducescatter"):
        assert delta("hvps_collectives_total", op=op) == 1
    assert delta("hvps_negotiation_seconds_count") == 6
    assert delta("hvps_fusion_buffer_fill_ratio_count") == 2
    threshold = hvps.runtime.state.settings().fusion_threshold
    assert delta("hvps_fusion_buffer_fill_ratio_sum") == pytest.approx((4000 + 120) / threshold)
    assert value(after, "hvps_collective_seconds_sum", op="allreduce") > 0
    assert value(after, "hvps_stalls_total") == 0
    assert value(after, "hvps_errors_total", kind="mismatch") == 0


def test_optimizer_steps_samples_and_compression_ratio():
    before = scrape()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    steps = 4
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8)).sum().backward()
        opt.step()
        metrics.record_samples(5)
    after = scrape()
    count = value(after, "hvps_step_seconds_count") - value(before, "hvps_step_seconds_count")
    assert count == steps - 1, "step time is the time between two steps"
    assert value(after, "hvps_exposed_communication_seconds_count") - \
        value(before, "hvps_exposed_communication_seconds_count") == steps
    assert value(after, "hvps_samples_total") - value(before, "hvps_samples_total") == 5 * steps
    assert value(after, "hvps_compression_ratio") == opt.compression.stats.ratio
    assert value(after, "hvps_step_seconds_sum") > value(before, "hvps_step_seconds_sum")


def test_checkpoint_save_and_load_durations_and_bytes(tmp_path):
    ckpt = hvd.CheckpointManager(tmp_path / "ckpt")
    model = torch.nn.Linear(50, 50)
    path = ckpt.save(0, model=model)
    assert ckpt.load(model=model) == 1
    samples = scrape()
    size = os.path.getsize(path)
    for op in ("save", "load"):
        assert value(samples, "hvps_checkpoint_seconds_count", operation=op) == 1
        assert value(samples, "hvps_checkpoint_bytes_total", operation=op) == size
        assert value(samples, "hvps_checkpoint_last_bytes", operation=op) == size
        assert 0 < value(samples, "hvps_checkpoint_last_seconds", operation=op) < 60


def test_store_tables_cache_and_traffic(tmp_path):
    """A sharded table's cache counters and memory, read at scrape time, per table (a cache in
    front of the disk tier: in front of the host tier on the CPU none is built)."""
    from hvps.store import ShardedEmbeddingBag

    table = ShardedEmbeddingBag(1000, 8, mode="sum", name="metrics_table", cache_rows=20, tier="disk",
                                disk_dir=tmp_path)
    host = ShardedEmbeddingBag(1000, 8, mode="sum", name="metrics_host", cache_rows=20, device="cpu")
    host(torch.tensor([[1, 2]])).sum().backward()
    assert host.stats()["cache"] == "bypassed: host tier" and "hits" not in host.stats()
    g = torch.Generator().manual_seed(3)
    for _ in range(5):  # more distinct rows than the cache holds: misses and evictions
        table(torch.randint(0, 1000, (16, 2), generator=g)).sum().backward()
    counts = table.stats()
    assert counts["misses"] > 0 and counts["evictions"] > 0
    samples = scrape()
    for metric, key in (("hvps_store_cache_hits_total", "hits"), ("hvps_store_cache_misses_total", "misses"),
                        ("hvps_store_cache_evictions_total", "evictions"), ("hvps_store_sent_bytes_total", "bytes_sent")):
        assert value(samples, metric, rank=0, table="metrics_table") == counts[key]
    for direction, key in (("to_cache", "bytes_to_cache"), ("to_tier", "bytes_to_tier"), ("bypass", "bytes_bypass")):
        assert value(samples, "hvps_store_tier_bytes_total", table="metrics_table", direction=direction) == counts[key]
    assert counts["bytes_to_cache"] > 0
    assert value(samples, "hvps_store_memory_bytes", table="metrics_table", tier="disk") == counts["tier_bytes"] > 0
    assert value(samples, "hvps_store_memory_bytes", table="metrics_table", tier="cache") == counts["cache_bytes"] > 0
    assert value(samples, "hvps_store_memory_bytes", table="metrics_host", tier="cache") == 0
    assert value(samples, "hvps_store_cache_hits_total", table="metrics_host") == 0


def test_process_host_and_gpu_readings():
    samples = scrape()
    rss = value(samples, "hvps_process_resident_memory_bytes", rank=0)
    assert 10 * 2**20 < rss < 64 * 2**30
    assert value(samples, "hvps_process_cpu_seconds_total", rank=0) > 0
    assert value(samples, "hvps_process_threads", rank=0) >= 2
    meminfo = dict(line.split(":") for line in open("/proc/meminfo").read().splitlines())
    assert value(samples, "hvps_host_memory_total_bytes") == int(meminfo["MemTotal"].split()[0]) * 1024
    assert value(samples, "hvps_host_cpu_seconds_total", mode="idle") > 0
    gpu = [name for name, _ in samples if name.startswith("hvps_gpu_")]
    from hvps.metrics.nvml import close_nvml, open_nvml

    pynvml, reason = open_nvml()
    close_nvml(pynvml)
    if pynvml is None:
        assert gpu == [], f"no NVML here ({reason}), yet GPU metrics were served"
    else:
        assert "hvps_gpu_memory_total_bytes" in gpu


def test_off_means_no_server_and_no_prometheus_client():
    assert "HVPS_METRICS_PORT" not in os.environ
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    hvps.allreduce(np.ones(3, np.float32), name="off.ar")
    metrics.record_samples(2)
    assert metrics.current() is None and metrics._sink is None
    assert "prometheus_client" not in sys.modules, "metrics off must not even import prometheus_client"
    # (The process does listen: Open MPI's own sockets. Without prometheus_client and the
    # server thread none of them can be an exporter.)
    assert not [t for t in threading.enumerate() if t.name == "hvps-metrics"]
