"""Choosing a data plane: HVPS_BACKEND, HVPS_HIERARCHICAL_ALLREDUCE and HVPS_LOCAL_SIZE in one
process (world size 1, MPI singleton), and the messages a wrong choice gets."""

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **env)
    for key in ("HVPS_BACKEND", "HVPS_HIERARCHICAL_ALLREDUCE", "HVPS_LOCAL_SIZE"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=100)


_REPORT = "import hvps; hvps.init(); print(hvps.runtime.state.engine().backend.name); hvps.shutdown()"


@pytest.mark.parametrize("value, expected", [("mpi", "mpi"), ("tdist", "tdist"), ("auto", "mpi"), ("", "mpi")])
def test_backend_by_name(value, expected):
    # auto without a GPU (and without torch imported) is plain MPI
    proc = _run(_REPORT, HVPS_BACKEND=value)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_unknown_backend_names_the_choices():
    proc = _run(_REPORT, HVPS_BACKEND="nccl")
    assert proc.returncode != 0
    assert "HVPS_BACKEND='nccl' is unknown; choose one of auto, mpi, tdist" in proc.stderr


def test_hierarchical_on_one_node_falls_back_to_flat_with_a_warning():
    proc = _run(_REPORT, HVPS_HIERARCHICAL_ALLREDUCE="1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "mpi"
    assert "HVPS_HIERARCHICAL_ALLREDUCE=1 ignored" in proc.stderr


def test_local_size_must_divide_the_job():
    proc = _run(_REPORT, HVPS_LOCAL_SIZE="2")
    assert proc.returncode != 0
    assert "HVPS_LOCAL_SIZE='2' must be a positive divisor of the job size (1)" in proc.stderr


def test_tdist_moves_cpu_tensors_as_they_are():
    code = """
import torch, numpy as np, hvps
hvps.init()
t = torch.randn(1001)
out = hvps.allreduce(t, op=hvps.Sum)
assert isinstance(out, torch.Tensor) and torch.equal(out, t), out
arr = np.random.default_rng(0).random(7)
assert np.array_equal(hvps.allreduce(arr, op=hvps.Max), arr)
print("ok")
hvps.shutdown()
"""
    proc = _run(code, HVPS_BACKEND="tdist")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_mpi_backend_refuses_tensors_with_a_clear_message():
    code = """
import torch, hvps
hvps.init()
try:
    hvps.allreduce(torch.ones(3))
except TypeError as exc:
    print(exc)
hvps.shutdown()
"""
    proc = _run(code, HVPS_BACKEND="mpi")
    assert proc.returncode == 0, proc.stderr
    assert "the mpi backend does not move cpu tensors of dtype float32; pass a numpy array" in proc.stdout


def test_horovod_capability_queries():
    code = """
import torch, hvps.adapters.torch as hvd
hvd.init()
print(hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.gloo_enabled(), hvd.nccl_built() == 0,
      hvd.cuda_built(), hvd.rocm_built())
hvd.shutdown()
"""
    proc = _run(code, HVPS_BACKEND="tdist")
    assert proc.returncode == 0, proc.stderr
    # CPU torch here: gloo is there and in use; no NCCL, no CUDA
    assert proc.stdout.split() == ["True", "False", "True", "True", "True", "False", "False"]


def test_tdist_store_owns_its_listening_socket():
    """torch's TCPStore takes over the listening socket hvps hands it (``master_listen_fd``: libuv closes it
    when the store ends). hvps used to keep a Python socket on the same descriptor and close it again when
    the backend was freed: the store lost its listener while it still ran, and the descriptor number, reused
    by the next socket, was closed or polled twice; under ``hvpsrun --gloo`` that aborted a rank (SIGABRT in
    libuv's epoll) at a later ``hvps.init()``. Here the store outlives the backend, as it may: a client must
    still reach it."""
    code = """
import datetime, gc, hvps, torch.distributed as dist
hvps.init()
backend = hvps.runtime.state.engine().backend
store = backend.store
del backend
hvps.shutdown()
gc.collect()
client = dist.TCPStore("127.0.0.1", store.port, 1, False, datetime.timedelta(seconds=10), wait_for_workers=False)
client.set("k", "v")
assert store.get("k") == b"v"
print("ok")
"""
    proc = _run(code, HVPS_BACKEND="tdist")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
