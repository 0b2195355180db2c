"""benchmarks/step_gap.py end to end at tiny size: every contender's job runs under mpirun (2 ranks)
and the JSON holds positive step times and finite, positive derived ratios. No timing assertions."""

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, mpirun_path


@pytest.mark.timeout(180)
def test_step_gap_benchmark_tiny_end_to_end(tmp_path):
    out = tmp_path / "step_gap.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMPI_MCA_mpi_yield_when_idle="1")
    env.pop("HVPS_METRICS_PORT", None)
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "step_gap.py"), "--np", "2", "--rounds", "1",
           "--iters", "1", "--warmup", "1", "--image-size", "32", "--batch-size", "2", "--timeout", "150",
           "--mpirun", mpirun_path(), "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["contenders"] == ["hvps", "nocomm", "ddp", "raw"]
    for impl in result["contenders"]:
        assert result["median_s"][impl] > 0
        assert len(result["per_round_s"][impl]) == 1 and result["per_round_s"][impl][0] > 0
        assert all(t > 0 for t in result["jobs"][impl][0]["times_s"])
    for key in ("gap_ratio", "hvps_vs_ddp", "hvps_vs_nocomm"):
        # finite only: the sign and size of a speed ratio are for benchmarks/RESULTS.md, not pass/fail
        # (gap_ratio, a difference of step times, is negative whenever hvps's round happens to beat no-comm's)
        assert math.isfinite(result[key]), (key, result[key])
        assert len(result["per_round"][key]) == 1
    assert result["host"]["nproc"] >= 1 and result["command"][1].endswith("step_gap.py")
    assert "gap_ratio" in proc.stdout and "hvps_vs_ddp" in proc.stdout
