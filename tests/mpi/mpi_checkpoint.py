"""Inner multi-rank tests of hvps.checkpoint (run by tests/test_checkpoint_multirank.py).

Only rank 0 may touch the checkpoint directory: on every other rank the file-system calls
that could reach it (open, os.open, h5py.File, listing, stat) raise when given a path
inside it, for the whole duration of save() and load().
"""

import builtins
import contextlib
import os
import warnings

import h5py
import numpy as np
import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps.checkpoint.format import CheckpointError
from hvps.checkpoint.manager import CheckpointManager, file_name


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvps.init()
    yield


class StorageTouched(AssertionError):
    pass


@contextlib.contextmanager
def storage_guard(directory):
    """On ranks other than 0, any access to ``directory`` raises StorageTouched; on rank 0
    the accesses are counted."""
    root = os.path.realpath(directory)
    count = {"n": 0}

    def inside(p):
        try:
            return os.path.realpath(os.fspath(p)).startswith(root)
        except TypeError:
            return False

    def wrap(fn):
        def guarded(p, *a, **k):
            if not isinstance(p, int) and inside(p):
                if hvps.rank() != 0:
                    raise StorageTouched(f"rank {hvps.rank()} touched {p} via {fn.__name__}")
                count["n"] += 1
            return fn(p, *a, **k)
        guarded.__name__ = fn.__name__
        return guarded

    saved = {(builtins, "open"): builtins.open, (os, "open"): os.open, (os, "stat"): os.stat,
             (os, "listdir"): os.listdir, (os, "scandir"): os.scandir, (os, "replace"): os.replace,
             (os, "mkdir"): os.mkdir, (os, "unlink"): os.unlink}
    orig_h5 = h5py.File.__init__

    def h5_init(self, name, *a, **k):
        if inside(name):
            if hvps.rank() != 0:
                raise StorageTouched(f"rank {hvps.rank()} opened {name} with h5py")
            count["n"] += 1
        return orig_h5(self, name, *a, **k)

    try:
        for (mod, attr), fn in saved.items():
            setattr(mod, attr, wrap(fn))
        h5py.File.__init__ = h5_init
        yield count
    finally:
        for (mod, attr), fn in saved.items():
            setattr(mod, attr, fn)
        h5py.File.__init__ = orig_h5


def fresh_dir(shared_dir, name):
    d = shared_dir / f"ckpt-{name}"
    if hvps.rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    hvps.barrier()
    return d


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4)).to(torch.bfloat16)


def test_save_load_identical_on_all_ranks_only_rank0_touches_storage(shared_dir):
    d = fresh_dir(shared_dir, "torch")
    rank, size = hvps.rank(), hvps.size()
    model = make_model(0)  # the same on every rank
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 16, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    residual = {"layer.0": torch.full((5,), float(rank)), "layer.1": torch.arange(3 + rank, dtype=torch.float64)}
    mgr = hvd.CheckpointManager(d, keep_last=2)
    with storage_guard(d) as touched:
        path = mgr.save(3, model=model, optimizer=opt, compression_state=residual, step=30)
    assert (path is not None) == (rank == 0)
    if rank == 0:
        assert touched["n"] > 0 and path.exists()
        with h5py.File(path) as f:
            assert f.attrs["world_size"] == size
            assert sorted(f["compression"]) == [f"rank_{r:05d}" for r in range(size)]
            assert sorted(f["rng"]) == [f"rank_{r:05d}" for r in range(size)]

    model2 = make_model(100 + rank)  # different on every rank
    opt2 = hvd.DistributedOptimizer(torch.optim.Adam(model2.parameters(), lr=0.5),
                                    named_parameters=model2.named_parameters())
    with storage_guard(d) as touched:
        assert mgr.load(model=model2, optimizer=opt2) == 4
    if rank == 0:
        assert touched["n"] > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, model2.state_dict()[k]), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][k]), (i, k)
    # this rank's own compression state came back
    cs = mgr.loaded.compression_state
    assert sorted(cs) == ["layer.0", "layer.1"]
    assert torch.equal(cs["layer.0"], residual["layer.0"]) and torch.equal(cs["layer.1"], residual["layer.1"])
    # identical bytes on all ranks: compare digests of the full model state
    flat = np.concatenate([hvd.checkpoint.tensor_to_array(v).reshape(-1).view(np.uint8)
                           for v in model2.state_dict().values()])
    gathered = hvps.allgather(flat.reshape(1, -1))
    for r in range(size):
        assert np.array_equal(gathered[r], gathered[0]), f"rank {r} differs from rank 0"


def test_rng_restored_per_rank(shared_dir):
    d = fresh_dir(shared_dir, "rng")
    torch.manual_seed(1000 + hvps.rank())
    mgr = hvd.CheckpointManager(d)
    mgr.save(0)
    expect = torch.rand(4)
    torch.manual_seed(5)
    mgr.load()
    assert torch.equal(torch.rand(4), expect)
    draws = hvps.allgather(expect.numpy().reshape(1, -1))
    assert len({draws[r].tobytes() for r in range(hvps.size())}) == hvps.size(), "per-rank RNG streams differ"


def test_latest_skips_corrupt_version_on_all_ranks(shared_dir):
    d = fresh_dir(shared_dir, "corrupt")
    mgr = CheckpointManager(d, keep_last=5)
    for e in range(3):
        mgr.save(e, model={"w": np.full(20000, e, np.float32)})
    if hvps.rank() == 0:
        path = d / file_name(2)
        with h5py.File(path) as f:
            off = f["model/w"].id.get_offset()
        with open(path, "r+b") as fh:
            fh.seek(off + 7)
            fh.write(b"\x7f")
    hvps.barrier()
    with storage_guard(d), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load() == 2
    assert mgr.loaded.epoch == 1 and (mgr.loaded.model["w"] == 1).all()
    if hvps.rank() == 0:
        assert any("skipping checkpoint" in str(w.message) for w in caught)
    with storage_guard(d), pytest.raises(CheckpointError, match="checksum mismatch"):
        mgr.load(2)  # raised on every rank, not only on rank 0


def test_save_failure_raises_on_every_rank(shared_dir):
    d = fresh_dir(shared_dir, "fail")
    blocker = d / "not-a-dir"
    if hvps.rank() == 0:
        blocker.write_text("x")
    hvps.barrier()
    mgr = CheckpointManager(blocker / "sub")
    with pytest.raises(CheckpointError):
        mgr.save(0, model={"w": np.ones(3)})


def test_world_size_mismatch(shared_dir):
    """A file whose per-rank state was saved by size+1 ranks (written by rank 0 alone)."""
    from hvps.checkpoint.format import root_attributes, write_file

    d = fresh_dir(shared_dir, "worldsize")
    size = hvps.size()
    if hvps.rank() == 0:
        comp = {f"rank_{r:05d}": {"r": np.full(3, r)} for r in range(size + 1)}
        write_file(d / file_name(5), {"model": {"w": np.ones(4)}, "compression": comp},
                   root_attributes(5, None, size + 1, "numpy", np.__version__))
    hvps.barrier()
    mgr = CheckpointManager(d)
    with pytest.raises(CheckpointError, match=f"saved per rank by {size + 1} ranks but this job has {size}"):
        mgr.load()
    assert mgr.load(drop_compression_state=True) == 6
    assert mgr.loaded.compression_state == {} and (mgr.loaded.model["w"] == 1).all()
