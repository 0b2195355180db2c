"""Outer tests: run the inner modules in tests/mpi under mpirun with 2 and 3
ranks and require a clean result on every rank (passed, nothing failed,
errored or skipped)."""

import numpy as np
import pytest

from conftest import run_mpi

NPS = [2, 3]

# (inner module, extra environment, hard timeout in seconds)
CASES = {
    "allreduce-mpi": ("mpi_allreduce.py", {"HVPS_ALLREDUCE_ALGORITHM": "mpi"}, 420),
    "allreduce-ring": ("mpi_allreduce.py", {"HVPS_ALLREDUCE_ALGORITHM": "ring"}, 420),
    "collectives": ("mpi_collectives.py", {}, 420),
    "async": ("mpi_async.py", {}, 240),
    "errors": ("mpi_errors.py", {"HVPS_STALL_CHECK_TIME_SECONDS": "3"}, 240),
    "torch": ("mpi_torch.py", {}, 420),
    "torch-train": ("mpi_torch_train.py", {}, 300),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_inner_module(np_, case, tmp_path):
    module, env, timeout = CASES[case]
    env = dict(env, HVPS_TEST_SHARED_DIR=str(tmp_path))
    result = run_mpi(module, np_, env=env, timeout=timeout)
    result.assert_all_passed()


def _load(path):
    with np.load(path) as f:
        return {k: f[k].copy() for k in f.files}


def _dtype_of(key):
    """The dtype named in a result key such as ``t12_float16_Sum`` or ``g0_3_float32_Sum``."""
    from hvps.dtypes import BY_NAME

    return next(dtype for name, dtype in BY_NAME.items() if f"_{name}_" in key)


def _order_may_differ(algorithm, np_, dtype):
    """Float sums with >2 ranks under MPI's own algorithm may round differently when fused."""
    return algorithm == "mpi" and np_ > 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_fusion_on_off_bit_identical(np_, algorithm, tmp_path):
    """Same async workload with fusion disabled (threshold 0), with the
    default threshold and with a tiny threshold (tensors bigger than the
    buffer): every result must be bit-identical across the runs."""
    configs = {"nofusion": {"HVPS_FUSION_THRESHOLD": "0"},
               "default": {},
               "tiny": {"HVPS_FUSION_THRESHOLD": "4096"}}
    outputs = {}
    for label, extra in configs.items():
        out = tmp_path / label
        out.mkdir()
        env = dict(extra, HVPS_ALLREDUCE_ALGORITHM=algorithm, HVPS_TEST_OUTDIR=str(out),
                   HVPS_CYCLE_TIME="5", HVPS_TEST_SHARED_DIR=str(tmp_path))
        if label == "default":
            env.pop("HVPS_FUSION_THRESHOLD", None)
        result = run_mpi("mpi_fusion.py", np_, env=env, timeout=300)
        result.assert_all_passed()
        outputs[label] = [_load(out / f"rank{r}.npz") for r in range(np_)]

    problems = []
    base = outputs["nofusion"]
    # every rank must hold the same bytes as rank 0 within each run
    for label, per_rank in outputs.items():
        for r in range(1, np_):
            for k in per_rank[0]:
                if not np.array_equal(per_rank[0][k], per_rank[r][k]):
                    problems.append(f"{label}: rank {r} differs from rank 0 for {k}")
    for label in ("default", "tiny"):
        for r in range(np_):
            assert base[r].keys() == outputs[label][r].keys()
            for k in base[r]:
                a, b = base[r][k], outputs[label][r][k]  # raw bytes
                dtype = _dtype_of(k)
                if _order_may_differ(algorithm, np_, dtype):
                    # MPI picks its reduction algorithm (and so the float summation
                    # order) by message size; hvps's ring folds in rank order always.
                    a, b = (x.view(dtype).astype(np.float64) for x in (a, b))
                    ok = np.allclose(a, b, rtol=1e-2, atol=1e-2)
                else:
                    ok = np.array_equal(a, b)
                if not ok:
                    problems.append(f"{label} vs nofusion: rank {r} tensor {k} differs")
    if problems:
        pytest.fail(f"{len(problems)} mismatches (first 40):\n  " + "\n  ".join(problems[:40]),
                    pytrace=False)
