"""Checkpoints of the sharded optimizer (issue 39, item 4) in one process: the re-sharding arithmetic
(N -> M for N, M in 1..4, uneven sizes), and the refusal of shards that are missing, damaged, of another
checkpoint or of another model, with ``load("latest")`` falling back to the previous version.

The multi-rank saves and loads (at 2 and 3 ranks, into one process, emulated at 1..4 ranks) are in
tests/mpi/mpi_sharded_optimizer.py, inside the shared jobs of tests/test_multirank.py.
"""

import shutil
import warnings

import h5py
import numpy as np
import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps.adapters.torch import sharded_checkpoint as sc
from hvps.checkpoint.format import CheckpointError, write_file
from hvps.checkpoint.manager import CheckpointManager as CoreManager
from hvps.checkpoint.resharding import param_pieces, shard_bounds, shard_numel, source_pieces

SIZES = range(1, 5)
NUMELS = [1, 2, 5, 7, 13, 56]


@pytest.mark.parametrize("numel", NUMELS)
def test_resharding_n_to_m_gives_each_new_rank_exactly_its_block(numel):
    flat = np.arange(numel) + 100
    for saved in SIZES:
        s = shard_numel(numel, saved)
        shards = [np.concatenate([flat, np.zeros(s * saved - numel, int)])[r * s:(r + 1) * s] for r in range(saved)]
        for size in SIZES:
            covered = np.zeros(numel, int)
            for rank in range(size):
                lo, hi = shard_bounds(numel, size, rank)
                assert hi - lo == shard_numel(numel, size)
                block = np.zeros(hi - lo, int)
                for src, offset, at, n in source_pieces(lo, hi, numel, saved):
                    assert 0 <= offset and offset + n <= s and n > 0
                    block[at:at + n] = shards[src][offset:offset + n]
                    covered[lo + at:lo + at + n] += 1
                expected = np.zeros(hi - lo, int)
                real = flat[lo:min(hi, numel)]
                expected[:real.size] = real
                assert np.array_equal(block, expected), (numel, saved, size, rank)
            assert (covered == 1).all(), (numel, saved, size)


def test_param_pieces_split_parameters_at_block_edges():
    params = [(0, 0, 3), (1, 3, 4), (2, 7, 2)]  # 9 elements
    assert param_pieces(params, 0, 5) == [(0, 0, 0, 3), (1, 0, 3, 2)]
    assert param_pieces(params, 5, 10) == [(1, 2, 0, 2), (2, 0, 2, 2)]
    assert param_pieces(params, 9, 12) == []


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError):
        shard_numel(3, 0)
    with pytest.raises(ValueError):
        shard_bounds(3, 2, 2)
    with pytest.raises(ValueError):
        source_pieces(4, 2, 9, 2)


# ----------------------------------------------------------------------------- refusals (one rank)
@pytest.fixture(scope="module")
def one_rank():
    hvps.init()
    torch.set_num_threads(1)
    yield
    hvps.shutdown()


def _model(seed=1, width=5):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 3))


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=g)).square().sum().backward()
        opt.step()


def _sharded(model):
    return hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, foreach=False),
                                    named_parameters=model.named_parameters(), shard=True,
                                    bucket_cap_mb=20 * 4 / 2**20)


@pytest.fixture
def two_versions(one_rank, tmp_path):
    """Epochs 0 and 1 of a sharded Adam; the plain state_dict() of each."""
    model = _model()
    opt = _sharded(model)
    mgr = hvd.CheckpointManager(tmp_path / "run", fsync=False)
    states = []
    for epoch in range(2):
        _train(model, opt, 2, seed=epoch)
        mgr.save(epoch, model=model, optimizer=opt)
        states.append(opt.state_dict())
    return mgr, states


def _shard(mgr, epoch):
    return mgr.directory / f"optim-epoch-{epoch:06d}" / sc.shard_file_name(0, 1)


def _assert_state(opt, expected):
    got = opt.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def _assert_falls_back(mgr, states, match):
    """load("latest") skips epoch 1 with a warning naming ``match`` and loads epoch 0; load(1) raises."""
    model = _model(seed=7)
    opt = _sharded(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load(model=model, optimizer=opt) == 1
    assert any("skipping checkpoint epoch 1" in str(w.message) and match in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    _assert_state(opt, states[0])
    with pytest.raises(CheckpointError, match=match):
        mgr.load(1, model=_model(seed=7), optimizer=_sharded(_model(seed=7)))
    # a plain optimizer (consolidating on load) refuses it and falls back alike
    plain_model = _model(seed=7)
    plain = torch.optim.Adam(plain_model.parameters(), foreach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.load(model=plain_model, optimizer=plain) == 1
    _assert_state(plain, states[0])


def test_round_trip_into_sharded_and_plain(two_versions):
    mgr, states = two_versions
    opt = _sharded(_model(seed=7))
    assert mgr.load(model=_model(seed=7), optimizer=opt) == 2
    _assert_state(opt, states[1])
    plain_model = _model(seed=7)
    plain = torch.optim.Adam(plain_model.parameters(), foreach=False)
    assert mgr.load(model=plain_model, optimizer=plain) == 2
    _assert_state(plain, states[1])


def test_missing_shard(two_versions):
    mgr, states = two_versions
    _shard(mgr, 1).unlink()
    _assert_falls_back(mgr, states, "missing")


def test_damaged_shard(two_versions):
    mgr, states = two_versions
    path = _shard(mgr, 1)
    with h5py.File(path) as f:
        offset = f["optimizer/b00000/exp_avg"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x40]))
    _assert_falls_back(mgr, states, "checksum mismatch")


def test_shard_of_another_checkpoint(two_versions, tmp_path):
    mgr, states = two_versions
    other = _model(seed=3)
    other_opt = _sharded(other)
    _train(other, other_opt, 1, seed=9)
    other_mgr = hvd.CheckpointManager(tmp_path / "other", fsync=False)
    other_mgr.save(1, model=other, optimizer=other_opt)
    shutil.copyfile(_shard(other_mgr, 1), _shard(mgr, 1))
    _assert_falls_back(mgr, states, "is not the shard the manifest lists")


def test_shard_of_another_model_that_the_manifest_lists(two_versions):
    """A shard whose digest the manifest does list, but written for another model (fingerprint, datasets)."""
    mgr, states = two_versions
    ck = CoreManager(mgr.directory).read(1)
    manifest = ck.optimizer["sharded"]
    arrays = {"b00000": {"exp_avg": np.zeros(manifest["buckets"][0]["shard_numel"], np.float32)}}
    from hvps.checkpoint.format import root_attributes
    from hvps.checkpoint.shards import block_digests

    path = _shard(mgr, 1)
    header = write_file(path, {"optimizer": arrays, "extra": {
        "rank": 0, "world_size": 1, "fingerprint": "0" * 64,
        "blocks": {"b00000.exp_avg": block_digests(arrays["b00000"]["exp_avg"])}}},
        root_attributes(1, None, 1, sc.FRAMEWORK, torch.__version__), fsync=False)
    manifest["shards"][0]["sha256"] = header.manifest_sha256
    CoreManager(mgr.directory, keep_last=None, fsync=False).save(1, model=ck.model, optimizer=ck.optimizer,
                                                                   extra=ck.extra, rng=ck.rng)
    _assert_falls_back(mgr, states, "another model")


def test_manifest_of_another_model_is_refused_without_falling_back(two_versions):
    mgr, _ = two_versions
    model = _model(seed=7, width=6)
    with pytest.raises(CheckpointError, match="another model"):
        mgr.load(model=None, optimizer=_sharded(model))
    with pytest.raises(CheckpointError, match="does not fit"):
        mgr.load(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_retention_drops_shard_folders_and_names_are_optional(one_rank, tmp_path):
    model = _model()
    opt = _sharded(model)
    mgr = hvd.CheckpointManager(tmp_path, keep_last=2, fsync=False)
    for epoch in range(4):
        _train(model, opt, 1, seed=epoch)
        mgr.save(epoch, model=model, optimizer=opt)
    mgr.wait_for_retention()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("optim-")) == \
        ["optim-epoch-000002", "optim-epoch-000003"]
    # an optimizer wrapped without named_parameters loads it too (shapes and dtypes must match)
    unnamed = hvd.DistributedOptimizer(torch.optim.Adam(_model(seed=7).parameters(), foreach=False), shard=True)
    assert mgr.load(optimizer=unnamed) == 4
    _assert_state(unnamed, opt.state_dict())


def test_a_plain_optimizers_checkpoint_loads_into_a_sharded_one(one_rank, tmp_path):
    model = _model()
    plain = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    _train(model, plain, 2, seed=4)
    mgr = hvd.CheckpointManager(tmp_path, fsync=False)
    mgr.save(0, model=model, optimizer=plain)
    sharded = _sharded(_model(seed=7))
    assert mgr.load(optimizer=sharded) == 1
    _assert_state(sharded, plain.state_dict())


def test_a_shard_that_cannot_be_written_commits_nothing(two_versions):
    mgr, states = two_versions
    (mgr.directory / "optim-epoch-000002").write_text("in the way")
    model = _model()
    opt = _sharded(model)
    _train(model, opt, 1, seed=5)
    with pytest.raises(CheckpointError, match="saving the sharded optimizer state of epoch 2 failed"):
        mgr.save(2, model=model, optimizer=opt)
    assert [v.epoch for v in mgr.list()] == [0, 1]
    fresh = _sharded(_model(seed=7))
    assert mgr.load(optimizer=fresh) == 2
    _assert_state(fresh, states[1])
