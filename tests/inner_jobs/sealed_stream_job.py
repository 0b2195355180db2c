"""One job of tests/test_sealed_stream.py: collectives over the sealed data plane whose messages stream chunk by
chunk (HVPS_RING_CHUNK_BYTES odd, so chunks split elements; every chunk in several MPI pieces), checked bit for
bit against the fold in rank order computed here from every rank's inputs. Prints 'SEALED STREAM OK' per rank."""

import numpy as np

import hvps

hvps.init()
size, rank = hvps.size(), hvps.rank()


def inputs(key: str, count: int, dtype) -> list:
    """Every rank's input for ``key`` (each rank can make all of them)."""
    arrays = []
    for r in range(size):
        rng = np.random.default_rng([r, sum(map(ord, key))])
        arrays.append((rng.standard_normal(count) * 10.0 ** rng.integers(-6, 6, count)).astype(dtype))
    return arrays


def fold(arrays: list, ufunc=np.add) -> np.ndarray:
    out = arrays[0].copy()
    for term in arrays[1:]:
        ufunc(out, term, out=out)
    return out


for count in (1_000_003, 2, 5):  # many chunks; fewer elements than ranks (empty blocks); a few
    for dtype in (np.float32, np.float64):
        xs = inputs(f"sum{count}{dtype.__name__}", count, dtype)
        expect = fold(xs)
        got = hvps.allreduce(xs[rank], op=hvps.Sum, name=f"sum.{count}.{dtype.__name__}")
        assert got.tobytes() == expect.tobytes(), ("out of place", count, dtype)
        mine = xs[rank].copy()
        hvps.allreduce(mine, op=hvps.Sum, name=f"inplace.{count}.{dtype.__name__}", out=mine)
        assert mine.tobytes() == expect.tobytes(), ("in place", count, dtype)
ints = [np.arange(300_001, dtype=np.int64) * (r + 1) % 7919 for r in range(size)]
assert (hvps.allreduce(ints[rank], op=hvps.Max, name="max") == fold(ints, np.maximum)).all()
rows = [inputs(f"gather{r}", 70_001 * (r + 1), np.float32)[r] for r in range(size)]
assert hvps.allgather(rows[rank], name="gather").tobytes() == np.concatenate(rows).tobytes()
for root in range(size):
    data = inputs(f"bcast{root}", 500_009, np.float64)[root]
    mine = data.copy() if rank == root else np.zeros_like(data)
    assert hvps.broadcast(mine, root_rank=root, name=f"bcast{root}").tobytes() == data.tobytes(), root
print(f"SEALED STREAM OK rank {rank}", flush=True)
hvps.shutdown()
