"""Checkpoints of the sharded optimizer (stage 1-2) and of a ``fully_shard`` model (stage 3) (issue 39, item 4)
in one process: the re-sharding arithmetic (N -> M for N, M in 1..4, uneven sizes), and, for both stages, the
refusal of shards that are missing, damaged, of another checkpoint or of another model, with ``load("latest")``
falling back to the previous version; a stage 3 checkpoint loaded in a process without ``hvps.init()``.
And issue 39's re-sharding target between real jobs (tests/inner_jobs/reshard_job.py): saved by a 3-rank job,
loaded by a 4-rank job, a 2-rank job and one process that never starts hvps.

The multi-rank saves and loads inside one job (at 2 and 3 ranks, at one rank fewer, into one process, emulated at
1..4 ranks) are in tests/mpi/mpi_sharded_optimizer.py and tests/mpi/mpi_fully_sharded.py, inside the shared jobs of
tests/test_multirank.py.
"""

import os
import shutil
import signal
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, _base_env, mpirun_argv

import hvps
import hvps.adapters.torch as hvd
from hvps.adapters.torch import sharded_checkpoint as sc
from hvps.adapters.torch.fully_sharded import fully_shard
from hvps.checkpoint.format import CheckpointError, root_attributes, write_file
from hvps.checkpoint.manager import CheckpointManager as CoreManager
from hvps.checkpoint.resharding import param_pieces, shard_bounds, shard_numel, source_pieces
from hvps.checkpoint.shards import block_digests

SIZES = range(1, 5)
RESHARD_JOB = REPO_ROOT / "tests" / "inner_jobs" / "reshard_job.py"
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


class StageOneTwo:
    """A ShardedOptimizer over a plain model: its state in shards, the model in the dense file."""

    folder, stem, dataset, section = "optim", "optimizer", "optimizer/b00000/exp_avg", "optimizer"
    what = "the sharded optimizer state"

    def build(self, seed=1, width=5):
        model = _model(seed, width)
        return model, _sharded(model)


class StageThree:
    """A fully sharded model (two units) and a plain Adam over its shards: both in shards."""

    folder, stem, dataset, section = "model", "model", "model/g00000/values", "model"
    what = "the fully sharded model"

    def build(self, seed=1, width=5):
        model = _model(seed, width)
        fully_shard(model, units=[model[1]])
        return model, torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)


KINDS = {"stage1-2": StageOneTwo(), "stage3": StageThree()}


@pytest.fixture(params=list(KINDS))
def kind(request, one_rank):
    return KINDS[request.param]


def _snapshot(model, opt):
    """Parameters by name and optimizer state by position, flattened: alike for sharded and unsharded holders."""
    sd = opt.state_dict()
    state = {index: {k: v.reshape(-1).clone() if torch.is_tensor(v) else v for k, v in entry.items()}
             for index, entry in sd["state"].items()}
    params = {name: p.detach().reshape(-1).clone() for name, p in model.named_parameters()}
    return params, sd["param_groups"], state


def _assert_state(model, opt, expected):
    params, groups, state = _snapshot(model, opt)
    assert groups == expected[1]
    for name, value in expected[0].items():
        assert torch.equal(params[name], value), name
    for index, entry in expected[2].items():
        for key, value in entry.items():
            assert torch.equal(state[index][key], value) if torch.is_tensor(value) else state[index][key] == value


@pytest.fixture
def two_versions(kind, tmp_path):
    """Epochs 0 and 1 of Adam in shards; the snapshot of each."""
    return _two_epochs(*kind.build(), tmp_path / "run")


def _two_epochs(model, opt, directory):
    """Epochs 0 and 1 (two steps each) saved in ``directory``: ``(manager, the snapshot of each)``."""
    mgr = hvd.CheckpointManager(directory, fsync=False)
    states = []
    for epoch in range(2):
        _train(model, opt, 2, seed=epoch)
        mgr.save(epoch, model=model, optimizer=opt)
        states.append(_snapshot(model, opt))
    return mgr, states


def _shard(mgr, kind, epoch):
    return mgr.directory / f"{kind.folder}-epoch-{epoch:06d}" / f"{kind.stem}.00000-of-00001.h5"


def _plain():
    """An unsharded model and a plain Adam (what one process loads a checkpoint into)."""
    model = _model(seed=7)
    return model, torch.optim.Adam(model.parameters(), foreach=False)


def _assert_falls_back(mgr, kind, states, match):
    """load("latest") skips epoch 1 with a warning naming ``match`` and loads epoch 0; load(1) raises."""
    model, opt = kind.build(seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load(model=model, optimizer=opt) == 1
    assert any("skipping checkpoint epoch 1" in str(w.message) and match in str(w.message) for w in caught), \
        [str(w.message) for w in caught]
    _assert_state(model, opt, states[0])
    model, opt = kind.build(seed=7)
    with pytest.raises(CheckpointError, match=match):
        mgr.load(1, model=model, optimizer=opt)
    # a plain model and optimizer (reading every shard whole) refuse it and fall back alike
    plain_model, plain = _plain()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mgr.load(model=plain_model, optimizer=plain) == 1
    _assert_state(plain_model, plain, states[0])


def test_round_trip_into_sharded_and_plain(two_versions, kind):
    mgr, states = two_versions
    model, opt = kind.build(seed=7)
    assert mgr.load(model=model, optimizer=opt) == 2
    _assert_state(model, opt, states[1])
    plain_model, plain = _plain()
    assert mgr.load(model=plain_model, optimizer=plain) == 2
    _assert_state(plain_model, plain, states[1])


def test_missing_shard(two_versions, kind):
    mgr, states = two_versions
    _shard(mgr, kind, 1).unlink()
    _assert_falls_back(mgr, kind, states, "missing")


def test_damaged_shard(two_versions, kind):
    mgr, states = two_versions
    path = _shard(mgr, kind, 1)
    with h5py.File(path) as f:
        offset = f[kind.dataset].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x40]))
    _assert_falls_back(mgr, kind, states, "checksum mismatch")


def test_shard_of_another_checkpoint(two_versions, kind, tmp_path):
    mgr, states = two_versions
    other, other_opt = kind.build(seed=3)
    _train(other, other_opt, 1, seed=9)
    other_mgr = hvd.CheckpointManager(tmp_path / "other", fsync=False)
    other_mgr.save(1, model=other, optimizer=other_opt)
    shutil.copyfile(_shard(other_mgr, kind, 1), _shard(mgr, kind, 1))
    _assert_falls_back(mgr, kind, states, "is not the shard the manifest lists")


def test_shard_of_another_model_that_the_manifest_lists(two_versions, kind):
    """A shard whose digest the manifest does list, but written for another model (fingerprint, datasets)."""
    mgr, states = two_versions
    ck = CoreManager(mgr.directory).read(1)
    manifest = getattr(ck, kind.section)["sharded" if kind.section == "optimizer" else "fully_sharded"]
    section, group, key = kind.dataset.split("/")
    arrays = {group: {key: np.zeros(3, np.float32)}}
    framework = sc.FRAMEWORK if kind.section == "optimizer" else "hvps.fully_shard"
    path = _shard(mgr, kind, 1)
    header = write_file(path, {section: arrays, "extra": {
        "rank": 0, "world_size": 1, "fingerprint": "0" * 64,
        "blocks": {f"{group}.{key}": block_digests(arrays[group][key])}}},
        root_attributes(1, None, 1, framework, torch.__version__), fsync=False)
    manifest["shards"][0]["sha256"] = header.manifest_sha256
    CoreManager(mgr.directory, keep_last=None, fsync=False).save(1, model=ck.model, optimizer=ck.optimizer,
                                                                   extra=ck.extra, rng=ck.rng)
    _assert_falls_back(mgr, kind, states, "another model")


def test_manifest_of_another_model_is_refused_without_falling_back(two_versions, kind):
    mgr, _ = two_versions
    model, opt = kind.build(seed=7, width=6)
    with pytest.raises(CheckpointError, match="another model"):
        mgr.load(model=model if kind.section == "model" else None, optimizer=opt)
    with pytest.raises(CheckpointError, match="does not fit"):
        mgr.load(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_retention_drops_shard_folders(kind, tmp_path):
    model, opt = kind.build()
    mgr = hvd.CheckpointManager(tmp_path, keep_last=2, fsync=False)
    for epoch in range(4):
        _train(model, opt, 1, seed=epoch)
        mgr.save(epoch, model=model, optimizer=opt)
    mgr.wait_for_retention()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f"{kind.folder}-")) == \
        [f"{kind.folder}-epoch-000002", f"{kind.folder}-epoch-000003"]


def test_a_shard_that_cannot_be_written_commits_nothing(two_versions, kind):
    mgr, states = two_versions
    (mgr.directory / f"{kind.folder}-epoch-000002").write_text("in the way")
    model, opt = kind.build()
    _train(model, opt, 1, seed=5)
    with pytest.raises(CheckpointError, match=f"saving {kind.what} of epoch 2 failed"):
        mgr.save(2, model=model, optimizer=opt)
    assert [v.epoch for v in mgr.list()] == [0, 1]
    fresh, fresh_opt = kind.build(seed=7)
    assert mgr.load(model=fresh, optimizer=fresh_opt) == 2
    _assert_state(fresh, fresh_opt, states[1])


# ----------------------------------------------------------------------------- stage 1-2 only
def test_names_are_optional(one_rank, tmp_path):
    model = _model()
    opt = _sharded(model)
    _train(model, opt, 1, seed=0)
    mgr = hvd.CheckpointManager(tmp_path, fsync=False)
    mgr.save(0, model=model, optimizer=opt)
    # an optimizer wrapped without named_parameters loads it too (shapes and dtypes must match)
    unnamed = hvd.DistributedOptimizer(torch.optim.Adam(_model(seed=7).parameters(), foreach=False), shard=True)
    assert mgr.load(optimizer=unnamed) == 1
    _assert_state(model, unnamed, _snapshot(model, opt))


def test_a_plain_optimizers_checkpoint_loads_into_a_sharded_one(one_rank, tmp_path):
    model = _model()
    plain = torch.optim.Adam(model.parameters(), lr=0.01, foreach=False)
    _train(model, plain, 2, seed=4)
    mgr = hvd.CheckpointManager(tmp_path, fsync=False)
    mgr.save(0, model=model, optimizer=plain)
    sharded = _sharded(_model(seed=7))
    assert mgr.load(optimizer=sharded) == 1
    _assert_state(model, sharded, _snapshot(model, plain))


# ----------------------------------------------------------------------------- stage 3 only
def test_an_optimizer_not_over_the_shards_is_refused(one_rank, tmp_path):
    model = _model()
    fully_shard(model)
    mgr = hvd.CheckpointManager(tmp_path, fsync=False)
    with pytest.raises(CheckpointError, match="ShardedOptimizer over a fully sharded model"):
        mgr.save(0, model=model, optimizer=_sharded(model))
    with pytest.raises(CheckpointError, match="not a shard of the fully sharded model"):
        mgr.save(0, model=model, optimizer=torch.optim.SGD(_model().parameters(), lr=0.1))
    assert not list(tmp_path.iterdir())


def test_fully_sharded_checkpoint_loads_in_a_process_without_hvps_init(one_rank, tmp_path):
    """Inference and export: the shards read into an unsharded model and a plain optimizer, hvps not running."""
    model, opt = StageThree().build()
    _train(model, opt, 2, seed=1)
    hvd.CheckpointManager(tmp_path, fsync=False).save(0, model=model, optimizer=opt)
    expected = _snapshot(model, opt)
    hvps.shutdown()
    try:
        plain_model, plain = _plain()
        assert hvd.CheckpointManager(tmp_path).load(model=plain_model, optimizer=plain) == 1
        _assert_state(plain_model, plain, expected)
        assert plain_model[0].weight.shape == (5, 4)
    finally:
        hvps.init()


# ----------------------------------------------------------------------------- a replicated run's dense checkpoint
@pytest.fixture
def dense_versions(one_rank, tmp_path):
    """Epochs 0 and 1 of a replicated model with Adam, saved dense; the snapshot of each."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, foreach=False),
                                   named_parameters=model.named_parameters())
    return _two_epochs(model, opt, tmp_path / "dense")


def _damage(path):
    """Flip one byte of the first tensor's data in a dense checkpoint file."""
    with h5py.File(path) as f:
        offset = f["model"]["0.weight"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(offset + 3)
        byte = fh.read(1)
        fh.seek(offset + 3)
        fh.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_dense_checkpoint_loads_into_sharded_targets_and_a_damaged_one_falls_back(dense_versions, kind):
    """Into a fully sharded model and its Adam, and into a ShardedOptimizer: the saved state exactly; a damaged
    newest version is skipped with a warning, as for an unsharded target."""
    mgr, states = dense_versions
    model, opt = KINDS[kind].build(seed=7)
    assert mgr.load(model=model, optimizer=opt) == 2
    _assert_state(model, opt, states[1])
    _damage(mgr.path_of(1))
    model, opt = KINDS[kind].build(seed=7)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        assert mgr.load(model=model, optimizer=opt) == 1
    _assert_state(model, opt, states[0])


def test_a_dense_checkpoint_of_another_model_is_refused_by_a_fully_sharded_one(dense_versions):
    mgr, states = dense_versions
    model, opt = StageThree().build(seed=7, width=6)
    with pytest.raises(CheckpointError, match=r"does not fit the given fully sharded(.|\n)*model.0.weight: "
                                              r"checkpoint \[5, 4\], model \[6, 4\]"):
        mgr.load(model=model, optimizer=opt)
    model, _ = StageThree().build(seed=7)
    with pytest.raises(CheckpointError, match="not a shard of the fully sharded model"):
        mgr.load(model=model, optimizer=torch.optim.Adam(_model().parameters()))
    with pytest.raises(CheckpointError, match="optimizer class: checkpoint Adam, given SGD"):
        mgr.load(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert mgr.load(model=model) == 2  # the parameters alone
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().reshape(-1), states[1][0][name]), name


# ----------------------------------------------------------------------------- a ShardedOptimizer run's checkpoint
def test_a_stage_one_two_checkpoint_loads_into_a_fully_sharded_model_and_a_deleted_shard_falls_back(one_rank,
                                                                                                     tmp_path):
    """Dense model plus sharded optimizer state into a fully sharded model and its Adam: the saved state exactly;
    with the newest version's optimizer shard deleted, ``load("latest")`` warns and loads the one before."""
    mgr, states = _two_epochs(*StageOneTwo().build(), tmp_path / "stage12")
    model, opt = StageThree().build(seed=7)
    assert mgr.load(model=model, optimizer=opt) == 2
    _assert_state(model, opt, states[1])
    _shard(mgr, StageOneTwo(), 1).unlink()
    model, opt = StageThree().build(seed=7)
    with pytest.warns(RuntimeWarning, match="skipping checkpoint epoch 1(.|\n)*missing"):
        assert mgr.load(model=model, optimizer=opt) == 1
    _assert_state(model, opt, states[0])


def test_a_stage_one_two_checkpoint_of_another_model_is_refused_by_a_fully_sharded_one(one_rank, tmp_path):
    mgr, _ = _two_epochs(*StageOneTwo().build(), tmp_path / "stage12")
    model, opt = StageThree().build(seed=7, width=6)
    with pytest.raises(CheckpointError, match=r"stage 1-2 checkpoint does not fit(.|\n)*model.0.weight: "
                                              r"checkpoint \[5, 4\], model \[6, 4\](.|\n)*parameter 0: checkpoint "
                                              r"has '0.weight' \[5, 4\]"):
        mgr.load(model=model, optimizer=opt)
    model, _ = StageThree().build(seed=7)
    with pytest.raises(CheckpointError, match="optimizer class: checkpoint Adam, given SGD"):
        mgr.load(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# ----------------------------------------------------------------------------- an optimizer over the shards, alone
@pytest.mark.parametrize("saved", ["dense", "stage1-2", "stage3"])
def test_the_optimizer_of_a_fully_sharded_model_loads_alone(one_rank, tmp_path, saved):
    """``load(optimizer=opt)`` without the model: the shards name their model (whole shapes, this rank's slices);
    the optimizer takes the saved state exactly, the model's parameters are left as they are."""
    if saved == "dense":
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01, foreach=False),
                                       named_parameters=model.named_parameters())
    else:
        model, opt = KINDS[saved].build()
    mgr, states = _two_epochs(model, opt, tmp_path / saved)
    model, opt = StageThree().build(seed=7)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert mgr.load(optimizer=opt) == 2
    _assert_state(model, opt, (params, *states[1][1:]))
    with pytest.raises(CheckpointError, match="optimizer class: checkpoint Adam, given SGD"):
        mgr.load(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# ----------------------------------------------------------------------------- N -> M between real jobs
@pytest.mark.timeout(900)
def test_checkpoints_saved_at_three_ranks_continue_bit_identically_at_four_two_and_one(tmp_path):
    """Stage 1-2 and stage 3 Adam runs saved by a real 3-rank job load in a real 4-rank job (blocks that straddle
    the saved shards), a real 2-rank job and one process that never starts hvps (an unsharded model and a plain
    Adam), and each continues bit for bit as the uninterrupted one-process run (every rank of each job checks)."""
    for mode, np_ in (("save", 3), ("load", 4), ("load", 2), ("plain", 1)):
        argv = [sys.executable, str(RESHARD_JOB), mode, str(tmp_path)]
        cmd, env = (argv, _base_env(None)) if mode == "plain" else mpirun_argv(np_, argv, _base_env(None))
        proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out = proc.communicate(timeout=200)[0].decode(errors="replace")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, f"the {mode} job at {np_} ranks failed:\n{out}"
        for rank in range(np_):
            assert f"RESHARD OK {mode} rank {rank} of {np_}" in out, out
