"""Outer tests: run the inner modules in tests/mpi under mpirun with 2 and 3
ranks and require a clean result on every rank (passed, nothing failed,
errored or skipped).

Every case of this module at one rank count shares one mpirun job (``inner_cases``: one MPI
start-up and one torch import per job); each test still checks its own cases rank by rank."""


import ml_dtypes
import numpy as np
import pytest
from conftest import case

NPS = [2, 3]

# (inner module, extra environment, hard timeout in seconds). The cases without HVPS_SHM run on the default data
# plane, the node's shared memory over MPI (HVPS_SHM=auto); those about another plane say HVPS_SHM=0.
CASES = {
    "allreduce-mpi": ("mpi_allreduce.py", {"HVPS_ALLREDUCE_ALGORITHM": "mpi", "HVPS_SHM": "0"}, 420),
    "allreduce-ring": ("mpi_allreduce.py", {"HVPS_ALLREDUCE_ALGORITHM": "ring", "HVPS_SHM": "0"}, 420),
    "collectives": ("mpi_collectives.py", {}, 420),
    "async": ("mpi_async.py", {}, 240),
    "errors": ("mpi_errors.py", {"HVPS_STALL_CHECK_TIME_SECONDS": "3"}, 240),
    "fast-lane": ("mpi_fast_lane.py", {"HVPS_STALL_CHECK_TIME_SECONDS": "3"}, 240),
    "torch": ("mpi_torch.py", {}, 420),
    "torch-train": ("mpi_torch_train.py", {}, 300),
    "shm": ("mpi_shm.py", {"HVPS_SHM": "1"}, 240),
    "autotune": ("mpi_autotune.py", {"HVPS_AUTOTUNE": "1", "HVPS_AUTOTUNE_WARMUP_STEPS": "1",
                                     "HVPS_AUTOTUNE_STEPS_PER_SAMPLE": "2"}, 240),
}
# The whole foundation suite again on the torch.distributed data plane (gloo on CPU, without shared memory: jobs
# without MPI run on shared memory over it by default, in test_gloo_run.py).
CASES.update({
    f"{name}-tdist": (module, dict(env, HVPS_BACKEND="tdist", HVPS_SHM="0"), timeout)
    for name, (module, env, timeout) in list(CASES.items())
    # the algorithm setting is the MPI backend's; one allreduce run suffices. Autotune is the engine's. The fast
    # lane needs the node's segment (its tdist run is in test_gloo_run.py's jobs, on shared memory by default).
    if name not in ("allreduce-ring", "autotune", "shm", "fast-lane")
})
# The collectives over the sealed data plane (HVPS_ENCRYPT), every pair of ranks sealed as if on two hosts.
CASES["collectives-encrypted"] = ("mpi_collectives.py", {"HVPS_ENCRYPT": "all"}, 420)
CASES["elastic-state"] = ("mpi_elastic_state.py", {}, 240)  # hvd.elastic front end; one data plane suffices
# ZeRO stage 1-2 (issue 39); one data plane suffices. Dynamic process sets: a checkpoint saved by every rank is
# re-sharded over fewer of them.
CASES["sharded-optimizer"] = ("mpi_sharded_optimizer.py", {"HVPS_DYNAMIC_PROCESS_SETS": "1"}, 240)
# ZeRO stage 3 (issue 39); one data plane. Dynamic process sets: its checkpoint too is re-sharded over fewer ranks.
CASES["fully-sharded"] = ("mpi_fully_sharded.py", {"HVPS_DYNAMIC_PROCESS_SETS": "1"}, 240)


def _inner_module_cases(np_, case_name):
    module, env, timeout = CASES[case_name]
    return [(np_, case(case_name, module, env=env, timeout=timeout))]


@pytest.mark.inner_cases(cases=_inner_module_cases)
@pytest.mark.parametrize("case_name", list(CASES))
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_inner_module(np_, case_name, inner_results):
    inner_results[case_name].assert_all_passed()


# Through a relay of the control-plane tree (HVPS_CONTROL_FANOUT=1: the chain 0 - 1 - 2, rank 1 passing rank 2's
# announcements up and rank 0's responses down): the collectives, and the mismatch, stall and join errors. At 2
# ranks a fan-out of 1 is the star again, so 3 ranks only.
# On MPI's data plane (HVPS_SHM=0): the collectives and errors above run on shared memory.
TREE_CASES = {
    "collectives-tree": ("mpi_collectives.py", {"HVPS_CONTROL_FANOUT": "1", "HVPS_SHM": "0"}, 420),
    "errors-tree": ("mpi_errors.py", {"HVPS_CONTROL_FANOUT": "1", "HVPS_STALL_CHECK_TIME_SECONDS": "3",
                                      "HVPS_SHM": "0"}, 240),
}


def _tree_cases(np_, case_name):
    module, env, timeout = TREE_CASES[case_name]
    return [(np_, case(case_name, module, env=env, timeout=timeout))]


@pytest.mark.inner_cases(cases=_tree_cases)
@pytest.mark.parametrize("case_name", list(TREE_CASES))
@pytest.mark.parametrize("np_", [3], ids=["np3"])
def test_inner_module_through_a_control_plane_relay(np_, case_name, inner_results):
    inner_results[case_name].assert_all_passed()


def _one_gib_cases(np_):
    # A job of its own: the shared job's processes already hold the memory of the cases before it,
    # and 3 ranks of that plus 2 GiB each (parameter and gradient) exceeded a 24 GiB machine.
    return [(np_, case("torch-one-gib", "mpi_torch_train.py", "-k", "one_gib", env={"HVPS_TEST_ONE_GIB": "1"},
                       timeout=300, job="one-gib"))]


@pytest.mark.inner_cases(cases=_one_gib_cases)
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_one_gib_gradient_through_distributed_optimizer(np_, inner_results):
    """A 1 GiB gradient beside small ones (mpi_torch_train.py, collected only with HVPS_TEST_ONE_GIB=1)."""
    inner_results["torch-one-gib"].assert_all_passed()


def _load(path):
    with np.load(path) as f:
        return {k: f[k].copy() for k in f.files}


def _dtype_of(key):
    """The dtype named in a result key such as ``t12_float16_Sum`` or ``g0_3_float32_Sum``."""
    from hvps.core.dtypes import BY_NAME

    return next(dtype for name, dtype in BY_NAME.items() if f"_{name}_" in key)


def _order_may_differ(algorithm, np_, dtype):
    """Float sums with >2 ranks under MPI's own algorithm may round differently when fused."""
    return algorithm == "mpi" and np_ > 2 and (dtype.kind == "f" or dtype.name == "bfloat16")


FUSION_CONFIGS = {"nofusion": {"HVPS_FUSION_THRESHOLD": "0"}, "default": {}, "tiny": {"HVPS_FUSION_THRESHOLD": "4096"}}


def _fusion_cases(np_, algorithm):
    return [(np_, case(f"fusion-{algorithm}-{label}", "mpi_fusion.py", timeout=300,
                       env=dict(extra, HVPS_ALLREDUCE_ALGORITHM=algorithm, HVPS_TEST_OUTDIR="{case_dir}",
                                HVPS_CYCLE_TIME="5", HVPS_SHM="0")))
            for label, extra in FUSION_CONFIGS.items()]


@pytest.mark.inner_cases(cases=_fusion_cases)
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_fusion_on_off_bit_identical(np_, algorithm, inner_results):
    """Same async workload with fusion disabled (threshold 0), with the
    default threshold and with a tiny threshold (tensors bigger than the
    buffer): every result must be bit-identical across the runs."""
    outputs = {}
    for label in FUSION_CONFIGS:
        result = inner_results[f"fusion-{algorithm}-{label}"]
        result.assert_all_passed()
        outputs[label] = [_load(result.case_dir / f"rank{r}.npz") for r in range(np_)]

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


def _hierarchical_cases(backend):
    env = {"HVPS_BACKEND": backend, "HVPS_HIERARCHICAL_ALLREDUCE": "1", "HVPS_LOCAL_SIZE": "2", "HVPS_SHM": "0",
           "HVPS_TEST_EXPECT_BACKEND": f"hierarchical-{backend}", "HVPS_TEST_EXPECT_LOCAL_SIZE": "2"}
    return [(4, case(f"hierarchical-{backend}-{module[4:-3]}", module, env=env, timeout=600))
            for module in ("mpi_topology.py", "mpi_allreduce.py")]


@pytest.mark.inner_cases(cases=_hierarchical_cases)
@pytest.mark.parametrize("backend", ["mpi", "tdist"])
def test_hierarchical_allreduce_on_emulated_nodes(backend, inner_results):
    """4 ranks as 2 emulated nodes of 2 (HVPS_LOCAL_SIZE): the whole allreduce suite through
    reduce-scatter in the node, allreduce across nodes, allgather in the node."""
    for result in inner_results.values():
        result.assert_all_passed()


def _tdist_vs_mpi_cases(np_):
    return [(np_, case(f"{module[4:-3]}-{backend}-vs", module, timeout=300,
                       env={"HVPS_BACKEND": backend, "HVPS_TEST_OUTDIR": "{case_dir}", "HVPS_TEST_EXPECT_BACKEND": backend,
                            "HVPS_SHM": "0"}))
            for backend in ("mpi", "tdist") for module in ("mpi_topology.py", "mpi_fusion.py")]


@pytest.mark.inner_cases(cases=_tdist_vs_mpi_cases)
@pytest.mark.parametrize("np_", NPS, ids=[f"np{n}" for n in NPS])
def test_tdist_matches_mpi_backend(np_, inner_results):
    """The same fused workload on both data planes: integer and bool results bit-identical,
    floats within rounding (gloo sums in its own order)."""
    outputs = {}
    for backend in ("mpi", "tdist"):
        inner_results[f"topology-{backend}-vs"].assert_all_passed()
        fusion = inner_results[f"fusion-{backend}-vs"]
        fusion.assert_all_passed()
        outputs[backend] = [_load(fusion.case_dir / f"rank{r}.npz") for r in range(np_)]
    problems, exact = [], 0
    for r in range(np_):
        mpi, tdist = outputs["mpi"][r], outputs["tdist"][r]
        assert mpi.keys() == tdist.keys()
        for k in mpi:
            dtype = _dtype_of(k)
            if dtype.kind in "iub":
                exact += 1
                ok = np.array_equal(mpi[k], tdist[k])
            else:  # a different summation order moves a result by a few units in the last place
                a, b = (x.view(dtype).astype(np.float64) for x in (mpi[k], tdist[k]))
                ulp = float(ml_dtypes.finfo(dtype).eps) * max(1.0, float(np.abs(a).max(initial=0.0)))
                ok = np.allclose(a, b, rtol=0, atol=4 * np_ * ulp)
            if not ok:
                problems.append(f"rank {r} tensor {k}")
    assert exact > 0, "the workload had no integer tensors to compare bit for bit"
    assert not problems, f"{len(problems)} tdist results differ from mpi: {problems[:20]}"
