"""Single-process tests of PowerSGD (issue 28): construction and bad input, which tensors are
compressed and as which matrix, the orthogonalisation, the shared Q start, the state's round trip.

Nothing here initialises hvps. The exchanges, the optimizer, checkpoints, mismatched settings and
NaN resets run on 2 and 3 ranks in ``tests/mpi/mpi_powersgd.py``.
"""

import ml_dtypes
import numpy as np
import pytest

import hvps.compression as C
from hvps.compression.framework_compressors import from_name
from hvps.compression.lowrank import PowerSGDCompressor

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs, argument", [
    ({"rank": 0}, "rank"), ({"rank": -2}, "rank"), ({"rank": 1.5}, "rank"), ({"rank": True}, "rank"),
    ({"min_compression_rate": 0.5}, "min_compression_rate"), ({"start_iter": -1}, "start_iter"),
    ({"epsilon": -1e-3}, "epsilon"),
])
def test_bad_hyper_parameters_raise_value_error_naming_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        C.powersgd(**kwargs)


def test_rank_larger_than_a_compressible_matrix_side_is_refused():
    comp = C.powersgd(rank=8)
    comp.prepare({"conv": (64, 3, 3, 3), "bias": (64,), "tiny": (2, 3)})  # tiny: dense at any rank
    with pytest.raises(ValueError, match=r"rank=8 .* 'fc', viewed as a 5x1000"):
        comp.prepare({"fc": (5, 1000)})


def test_integer_gradients_raise_type_error():
    for dtype in (np.int32, np.int64, np.uint8):
        with pytest.raises(TypeError, match="floating-point"):
            PowerSGDCompressor(2).check(np.zeros((8, 8), dtype))
    PowerSGDCompressor(2).check(np.zeros((8, 8), ml_dtypes.bfloat16))


def test_matrix_shape_views_first_dimension_and_applies_min_compression_rate():
    c = PowerSGDCompressor(rank=2, min_compression_rate=2)
    assert c.matrix_shape((64, 32, 3, 3)) == (64, 288)
    assert c.matrix_shape((1000, 2048)) == (1000, 2048)
    assert c.matrix_shape((64,)) is None and c.matrix_shape(()) is None
    # 8x8 = 64 elements vs (8 + 8) * 2 = 32 per factor pair: rate 2, not above 2 -> dense
    assert c.matrix_shape((8, 8)) is None and c.matrix_shape((9, 9)) == (9, 9)
    assert PowerSGDCompressor(rank=2, min_compression_rate=1).matrix_shape((8, 8)) == (8, 8)


def test_orthogonalize_gives_orthonormal_columns_spanning_the_same_space():
    rng = np.random.default_rng(5)
    p = rng.standard_normal((50, 4)).astype(np.float32)
    q = PowerSGDCompressor(4).orthogonalize(p.copy())
    np.testing.assert_allclose(q.T @ q, np.eye(4), atol=1e-5)
    # the same column space: projecting p on q gives p back
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-4)
    zero = PowerSGDCompressor(2).orthogonalize(np.zeros((6, 2), np.float32))  # epsilon: stays finite
    assert np.isfinite(zero).all()


def test_first_q_is_the_same_for_every_rank_and_differs_by_tensor_and_draw():
    a, b = PowerSGDCompressor(2, seed=3), PowerSGDCompressor(2, seed=3)
    assert np.array_equal(a.draw_q("w", 10, 0, np.float32), b.draw_q("w", 10, 0, np.float32))
    assert not np.array_equal(a.draw_q("w", 10, 0, np.float32), a.draw_q("w", 10, 1, np.float32))
    assert not np.array_equal(a.draw_q("w", 10, 0, np.float32), a.draw_q("v", 10, 0, np.float32))
    assert not np.array_equal(a.draw_q("w", 10, 0, np.float32), PowerSGDCompressor(2).draw_q("w", 10, 0, np.float32))


def test_state_dict_round_trip_and_names():
    comp = C.powersgd(rank=2)
    rng = np.random.default_rng(0)
    comp.state.qs["w"] = rng.standard_normal((7, 2)).astype(np.float32)
    comp.state.steps.update(w=12, b=12)
    comp.state.draws["w"] = 1
    comp.state.memory.residuals["w"] = rng.standard_normal((5, 7)).astype(np.float32)
    saved = comp.state_dict()
    assert sorted(saved) == ["powersgd.draw/w", "powersgd.q/w", "powersgd.step/b", "powersgd.step/w", "residual/w"]
    other = C.powersgd(rank=2)
    other.load_state_dict({k: np.copy(v) for k, v in saved.items()})
    assert other.state.steps == {"w": 12, "b": 12} and other.state.draws == {"w": 1}
    assert np.array_equal(other.state.qs["w"], saved["powersgd.q/w"])
    assert np.array_equal(other.state.memory.residuals["w"], saved["residual/w"])
    other.state.reset("w")
    assert "w" not in other.state.qs and "w" not in other.state.memory.residuals
    assert "residual/w" not in C.powersgd(rank=2, error_feedback=False).state_dict()


def test_names_registry_and_namespaces():
    assert repr(C.Compression.powersgd(rank=4)) == "Compression.powersgd(4)"
    assert C.create("powersgd", rank=2, start_iter=0).start_iter == 0
    assert from_name("powersgd(2)").compressor.rank == 2
    comp = C.powersgd(rank=2)
    assert not comp.summable and comp.compressor.summable  # two rounds: never an adapter's fused allreduce
    with pytest.raises(NotImplementedError, match="two rounds"):
        comp.compressor.compress(np.ones((4, 4), np.float32), "w")
