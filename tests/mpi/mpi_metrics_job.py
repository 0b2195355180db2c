"""A short real training job for tests/test_prometheus.py: every rank serves metrics
(HVPS_METRICS_PORT + local rank) while a Prometheus started by the outer test scrapes them.

It trains a small CNN with DistributedOptimizer (fp16 compression) for HVPS_TEST_METRICS_SECONDS,
runs the other collectives, saves and loads a checkpoint, and makes one collective stall on
rank 0 (rank 1 never submits it), so that every panel of the dashboard has something to show.
"""

import os
import time
import urllib.request

import numpy as np
import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps import metrics

pytestmark = pytest.mark.timeout(150)

SECONDS = float(os.environ.get("HVPS_TEST_METRICS_SECONDS", "10"))
BATCH = 16


def _scrape_value(name, **labels):
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics.current().url, timeout=10).read().decode()
    want = {k: str(v) for k, v in labels.items()}
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and want.items() <= s.labels.items())


def test_train_while_prometheus_scrapes():
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    exporter = metrics.current()
    assert exporter is not None and exporter.port == int(os.environ["HVPS_METRICS_PORT"]) + hvd.local_rank()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ckpt = hvd.CheckpointManager(os.path.join(os.environ["HVPS_TEST_SHARED_DIR"], "ckpt"))
    x, y = torch.randn(BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,))

    started, step, stop = time.monotonic(), 0, False
    while not stop:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        metrics.record_samples(BATCH)
        step += 1
        if step % 5 == 0:
            hvps.allgather(np.ones((rank + 1, 4), np.float32), name=f"job.ag.{step}")
            hvps.broadcast(np.arange(16, dtype=np.float32), root_rank=0, name=f"job.bc.{step}")
            hvps.alltoall(np.ones(2 * size, np.float32), name=f"job.a2a.{step}")
            hvps.reducescatter(np.ones(4 * size, np.float32), name=f"job.rs.{step}")
        if step == 20:
            ckpt.save(0, model=model, optimizer=opt)
            assert ckpt.load(model=model, optimizer=opt) == 1
        if step == 30 and rank == 0:  # rank 1 never submits it: a stall, reported after the stall time
            with pytest.raises(hvps.HvpsError, match="stall"):
                hvps.allreduce(np.ones(3, np.float32), name="job.lonely")
        if step == 30 and rank == 1:
            # Rank 1's next collective (job.stop.30) waits for rank 0, which waits in job.lonely: each blocks
            # the other, and the one submitted first stalls first. Arriving later makes job.lonely that one.
            time.sleep(1.0)
        if step % 10 == 0:  # every rank stops at the same step: rank 0's clock decides
            stop = hvps.broadcast_object(time.monotonic() - started > SECONDS, root_rank=0, name=f"job.stop.{step}")
        time.sleep(0.01)  # leave some CPU to Prometheus and the other rank on a small machine

    assert _scrape_value("hvps_stalls_total") == (1 if rank == 0 else 0)
    assert _scrape_value("hvps_stall_warnings_total") == (0 if rank == 0 else 1)
    assert _scrape_value("hvps_compression_ratio") == pytest.approx(2.0)
    assert _scrape_value("hvps_samples_total") == BATCH * step
    time.sleep(2.5)  # a few more scrapes (every second) see the final values
    hvps.barrier()
