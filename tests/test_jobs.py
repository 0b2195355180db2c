"""The single-node launch recipes in jobs/ (plain mpirun and hvpsrun) run the ResNet-50 harness for
real, on the MPI that hvpsrun's rule finds, with a bare environment (nothing on PATH but the
system's; for hvpsrun no HOME either)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, mpi_launcher

from hvps.runner.mpi_discovery import MpiImpl

TINY_BENCH = ("--batch-size 2 --image-size 32 --num-warmup-batches 1 --num-batches-per-iter 1 --num-iters 2 "
              "--threads-per-rank 1")


def _run_recipe(recipe: str, tmp_path, **extra) -> dict:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HVPS_PYTHON": sys.executable, "RESULTS_DIR": str(tmp_path),
           "BENCH_ARGS": TINY_BENCH, "HVPS_STALL_CHECK_TIME_SECONDS": "60", "NP": "2",
           "HVPS_MPIRUN": os.environ.get("HVPS_TEST_MPIRUN", ""), **extra}
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(["bash", str(REPO_ROOT / "jobs" / recipe)], env=env, capture_output=True, text=True,
                          timeout=400, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = list(tmp_path.glob("resnet50-*.json"))
    assert len(results) == 1, (results, proc.stdout[-2000:])
    return json.loads(results[0].read_text())


@pytest.mark.timeout(500)
@pytest.mark.skipif(mpi_launcher().impl is not MpiImpl.OPEN_MPI,
                    reason=f"jobs/mpirun/ holds Open MPI recipes; this MPI is {mpi_launcher().impl.value}")
def test_plain_mpirun_recipe(tmp_path):
    # plain mpirun is Open MPI's own: Open MPI 5 needs HOME, which only hvpsrun fills in
    result = _run_recipe("mpirun/resnet50-single-node.sh", tmp_path, HOME=str(tmp_path))
    assert result["distributed"]["ranks"] == 2 and result["distributed"]["total_img_s"]["median"] > 0, result


@pytest.mark.timeout(500)
def test_hvpsrun_recipe(tmp_path):
    result = _run_recipe("hvpsrun/resnet50-single-node.sh", tmp_path)
    assert result["distributed"]["ranks"] == 2 and result["distributed"]["total_img_s"]["median"] > 0, result
