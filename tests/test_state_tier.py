"""The optimizer state's disk tier (issue 39, item 3) in one process: steps bit-identical to in-memory state
(a plain optimizer, and ``ShardedOptimizer(state_tier="disk")`` at one rank over several buckets), state
loaded into the tier, no file left with a name, and a read-only or full filesystem refused at construction
with ``HvpsError`` (tiny tmpfs mounts; root only).

The multi-rank case (2 and 3 ranks, against one process, through a checkpoint) is in
tests/mpi/mpi_sharded_optimizer.py, inside the shared jobs of tests/test_multirank.py.
"""

import copy
import os
import subprocess

import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps import HvpsError
from hvps.adapters.torch.sharded_optimizer import ShardedOptimizer

SCALE = 2.0 ** -6
TINY_BUCKETS = 20 * 4 / 2**20  # 20 float32 elements: the 44-parameter model below spans three buckets (20, 4, 20)


@pytest.fixture(scope="module")
def one_rank():
    hvps.init()
    torch.set_num_threads(1)
    yield
    hvps.shutdown()


def _dyadic_model():
    """Weights that are multiples of 1/8 and a loss linear in the outputs: exact gradients in float32."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 5, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.round(p * 8) / 8)
    return model


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=2.0 ** -4, momentum=0.5, weight_decay=2.0 ** -5, foreach=False)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=2.0 ** -4, foreach=False)
    return torch.optim.Adam(params, lr=2.0 ** -4, foreach=False)


def _step(model, optimizer, step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(-4, 5, (6, 5), generator=g).float()
    t = torch.randint(-4, 5, (6, 5), generator=g).float()
    optimizer.zero_grad()
    (model(x) * t).sum().mul(SCALE).backward()
    optimizer.step()


def _assert_equal(model, ref, what):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{what}: {name} differs by {(a - b).abs().max()}"


def _elementwise_state(optimizer):
    return [v for entry in optimizer.state.values() for v in entry.values() if torch.is_tensor(v) and v.dim() > 0]


@pytest.mark.parametrize("kind", ["adam", "sgd", "adagrad"])
def test_a_plain_optimizer_steps_bit_identically_with_its_state_on_disk(kind, tmp_path):
    ref, model = _dyadic_model(), _dyadic_model()
    ref_opt, opt = _optimizer(kind, ref.parameters()), _optimizer(kind, model.parameters())
    tier = hvd.DiskStateTier(opt, tmp_path)
    assert tier.nbytes > 0 and os.listdir(tmp_path) == []  # reserved, and nameless from the start
    for step in range(4):
        _step(ref, ref_opt, step)
        _step(model, opt, step)
        _assert_equal(model, ref, f"{kind}, step {step}")
        assert all(tier.holds(v) for v in _elementwise_state(opt))
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # loaded state moves into the tier too
    assert all(tier.holds(v) for v in _elementwise_state(opt))
    tier.close()
    assert not any(tier.holds(v) for v in _elementwise_state(opt))
    _step(ref, ref_opt, 4)
    _step(model, opt, 4)
    _assert_equal(model, ref, f"{kind}, after close")


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_sharded_optimizer_with_a_disk_tier_matches_one_in_memory(one_rank, kind, tmp_path):
    ref, memory, disk = _dyadic_model(), _dyadic_model(), _dyadic_model()
    ref_opt = _optimizer(kind, ref.parameters())
    in_memory = ShardedOptimizer(_optimizer(kind, memory.parameters()), named_parameters=memory.named_parameters(),
                                 bucket_cap_mb=TINY_BUCKETS)
    tiered = hvd.DistributedOptimizer(_optimizer(kind, disk.parameters()), named_parameters=disk.named_parameters(),
                                      bucket_cap_mb=TINY_BUCKETS, shard=True, state_tier="disk", disk_dir=tmp_path)
    assert len(tiered._buckets) == 3 and tiered.state_tier is not None
    for step in range(4):
        for model, opt in ((ref, ref_opt), (memory, in_memory), (disk, tiered)):
            _step(model, opt, step)
        _assert_equal(disk, ref, f"{kind}, step {step}")
        _assert_equal(memory, ref, f"{kind}, step {step}")
        assert all(tiered.state_tier.holds(v) for v in _elementwise_state(tiered.shard_optimizer))
    consolidated = tiered.state_dict()
    expected = ref_opt.state_dict()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(consolidated["state"][index][key]), torch.as_tensor(value))
    tiered.load_state_dict(consolidated)
    assert all(tiered.state_tier.holds(v) for v in _elementwise_state(tiered.shard_optimizer))
    _step(ref, ref_opt, 4)
    _step(disk, tiered, 4)
    _assert_equal(disk, ref, f"{kind}, after reloading")
    old_tier = tiered.state_tier
    tiered.relayout(1, 0)  # elastic re-sharding: a new tier for the new shards, the old one dropped
    assert tiered.state_tier is not old_tier and old_tier.nbytes == 0
    tiered.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _step(ref, ref_opt, 5)
    _step(disk, tiered, 5)
    _assert_equal(disk, ref, f"{kind}, after a relayout")
    assert all(tiered.state_tier.holds(v) for v in _elementwise_state(tiered.shard_optimizer))
    tiered.close()
    assert tiered.state_tier is None


def test_tier_arguments_are_checked():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown state_tier 'nvme'"):
        ShardedOptimizer(_optimizer("adam", model.parameters()), state_tier="nvme")
    with pytest.raises(ValueError, match="needs disk_dir"):
        ShardedOptimizer(_optimizer("adam", model.parameters()), state_tier="disk")
    with pytest.raises(ValueError, match="needs a directory"):
        hvd.DiskStateTier(_optimizer("adam", model.parameters()), "")


@pytest.fixture
def mount(tmp_path):
    """``mount(options)``: a fresh tmpfs mounted with ``options`` (root only), unmounted afterwards."""
    mounted = []

    def make(options):
        where = tmp_path / f"mnt{len(mounted)}"
        where.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                                               capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def test_a_read_only_directory_is_refused_at_construction(mount):
    read_only = mount("ro,size=1m")
    model = torch.nn.Linear(64, 64)
    with pytest.raises(HvpsError, match=r"cannot create a file in .*mnt0.*read-only"):
        hvd.DiskStateTier(_optimizer("adam", model.parameters()), read_only)
    with pytest.raises(HvpsError, match="read-only"):
        hvd.DiskStateTier(_optimizer("adam", model.parameters()), read_only / "sub")


def test_a_full_filesystem_is_refused_at_construction_and_leaves_nothing(one_rank, mount):
    small = mount("size=64k")
    model = torch.nn.Linear(64, 64)  # Adam: 2 x 4160 floats, 33 KiB: more than the room left below
    (small / "filler").write_bytes(b"\0" * 48 * 1024)
    with pytest.raises(HvpsError, match=r"cannot reserve \d+ KiB in .*No space left.*the filesystem is full"):
        hvd.DiskStateTier(_optimizer("adam", model.parameters()), small)
    with pytest.raises(HvpsError, match="the filesystem is full"):
        ShardedOptimizer(_optimizer("adam", model.parameters()), named_parameters=model.named_parameters(),
                         state_tier="disk", disk_dir=small)
    assert os.listdir(small) == ["filler"]  # no half-reserved file, named or not, holds the room
    os.unlink(small / "filler")
    tier = hvd.DiskStateTier(_optimizer("adam", model.parameters()), small)  # room again: it fits
    assert tier.nbytes <= 64 * 1024
    tier.close()
