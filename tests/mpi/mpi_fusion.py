"""Inner multi-rank workload for the fusion on/off comparison.

Submits many small tensors of mixed sizes/dtypes/ops asynchronously, checks
every result against the numpy reference, and saves the raw result bytes to
$HVPS_TEST_OUTDIR/rank<R>.npz.  tests/test_multirank.py runs it with
different HVPS_FUSION_THRESHOLD values and compares the files bit for bit.
"""

import os
from pathlib import Path

import numpy as np
import pytest
from hvps_testutil import DTYPES, all_inputs, check_allreduce_result

import hvps

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    yield


def _items(size):
    rng = np.random.default_rng(2024)  # same description on every rank
    dtypes = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "bool"]
    items = []
    for i in range(300):
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        ops = ["Sum", "Max", "Min", "Product"] if dtype == "bool" else \
            ["Sum", "Average", "Min", "Max", "Product"]
        op = ops[int(rng.integers(len(ops)))]
        n = int(rng.choice([0, 1, 3, 17, 100, 1000, 4097, 30000]))
        scale = dtype != "bool" and op in ("Sum", "Average") and rng.random() < 0.3
        items.append((i, dtype, op, n, scale))
    return items


def test_fusion_workload():
    size, rank = hvps.size(), hvps.rank()
    out_dir = Path(os.environ["HVPS_TEST_OUTDIR"])
    items = _items(size)
    inputs = {i: all_inputs(DTYPES[d], (n,), f"fusion/{i}", size, op)
              for i, d, op, n, _ in items}
    handles = []
    for i, dtype, op, n, scale in items:
        kw = {"prescale_factor": 0.5, "postscale_factor": 2.0} if scale else {}
        handles.append(hvps.allreduce_async(inputs[i][rank].copy(), op=getattr(hvps, op), **kw))
    # grouped submissions too
    groups = []
    for g in range(5):
        ins = [all_inputs(np.float32, (k * 37 + g,), f"fusion/g{g}/{k}", size)
               for k in range(8)]
        groups.append((ins, hvps.grouped_allreduce_async([x[rank].copy() for x in ins],
                                                         op=hvps.Sum)))
    results = {}
    for (i, dtype, op, n, scale), h in zip(items, handles):
        res = np.asarray(h.wait())
        pre, post = (0.5, 2.0) if scale else (1.0, 1.0)
        check_allreduce_result(res, inputs[i], op, size, pre, post,
                               what=f"item {i} {dtype} {op} n={n} scale={scale}")
        results[f"t{i}_{dtype}_{op}"] = np.ascontiguousarray(res).reshape(-1).view(np.uint8)
    for g, (ins, h) in enumerate(groups):
        outs = h.wait()
        for k, (o, x) in enumerate(zip(outs, ins)):
            check_allreduce_result(np.asarray(o), x, "Sum", size, what=f"group {g} member {k}")
            results[f"g{g}_{k}_float32_Sum"] = \
                np.ascontiguousarray(o).reshape(-1).view(np.uint8)
    np.savez(out_dir / f"rank{rank}.npz", **results)


@pytest.mark.parametrize("in_place", [False, True])
def test_large_members_of_a_fused_group_are_reduced_where_they_live(in_place):
    """Members of REDUCED_ALONE_BYTES or more skip the fusion buffer (their own backend call);
    mixed with small ones, in place or not, scaled or not, every result matches numpy."""
    from hvps.dataplane.executors import REDUCED_ALONE_BYTES

    size, rank = hvps.size(), hvps.rank()
    edge = REDUCED_ALONE_BYTES // 8  # float64 elements at the boundary
    for op in ("Sum", "Average", "Min", "Max"):
        for dtype in (np.float32, np.float64, np.int32):
            shapes = [(3,), (edge * 2 + 1,), (17, 5), (edge - 1,), (0,), (edge,), (1,)]
            key = f"alone/{op}/{np.dtype(dtype).name}/{in_place}"
            ins = [all_inputs(dtype, shape, f"{key}/{k}", size, op) for k, shape in enumerate(shapes)]
            pre, post = (0.5, 2.0) if op in ("Sum", "Average") and dtype is not np.int32 else (1.0, 1.0)
            mine = [x[rank].copy() for x in ins]
            outs = hvps.grouped_allreduce(mine, op=getattr(hvps, op), prescale_factor=pre, postscale_factor=post,
                                          outs=mine if in_place else None)
            for k, (out, x) in enumerate(zip(outs, ins)):
                check_allreduce_result(np.asarray(out), x, op, size, pre, post, what=f"{key} member {k}")
                if in_place:
                    assert out is mine[k] or np.shares_memory(out, mine[k]), f"{key} member {k} not in place"


@pytest.mark.parametrize("op", ["Sum", "Average"])
def test_members_in_one_flat_buffer_on_some_ranks_only(op):
    """Where a rank's tensors lie is its own affair: rank 0 hands in views of one flat buffer (in
    place, back to back), the others separate arrays. Large members mixed with small ones must
    still make every rank run the same backend calls, and every result matches numpy."""
    from hvps.dataplane.executors import REDUCED_ALONE_BYTES

    size, rank = hvps.size(), hvps.rank()
    edge = REDUCED_ALONE_BYTES // 4  # float32 elements at the boundary
    shapes = [(5,), (edge + 3,), (301,), (edge * 2,), (17, 3)]
    key = f"layout/{op}"
    ins = [all_inputs(np.float32, shape, f"{key}/{k}", size, op) for k, shape in enumerate(shapes)]
    if rank == 0:
        flat = np.concatenate([x[rank].reshape(-1) for x in ins])
        bounds = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        mine = [flat[lo:hi].reshape(s) for lo, hi, s in zip(bounds, bounds[1:], shapes)]
    else:
        mine = [x[rank].copy() for x in ins]
    outs = hvps.grouped_allreduce(mine, op=getattr(hvps, op), outs=mine, name=key)
    for k, (out, x) in enumerate(zip(outs, ins)):
        check_allreduce_result(np.asarray(out), x, op, size, what=f"{key} member {k} (rank 0 flat)")
