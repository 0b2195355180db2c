"""hvps.store: unit tests of its parts (one process) and the multi-rank suite at 2 and 3 ranks."""

import math

import pytest
import torch
from conftest import SHARED_JOBS, case

from hvps.store import HashPartition, RangePartition, RowAdagrad, RowAdam, RowCache, RowSGD, ShardedEmbeddingBag
from hvps.store.exchange import gather_pays
from hvps.store.init import hash_uniform
from hvps.store.optim import make_optimizer
from hvps.store.table import ShardedTable, StoreOptions
from hvps.store.tiers import DiskTier, HostTier, discard_tier


@pytest.mark.unit
@pytest.mark.parametrize("cls", [HashPartition, RangePartition])
@pytest.mark.parametrize("rows,parts", [(1, 1), (10, 3), (97, 4), (64, 2), (5, 7)])
def test_partitions_are_bijections(cls, rows, parts):
    p = cls(rows, parts)
    ids = torch.arange(rows)
    owner, slot = p.owner(ids), p.slot(ids)
    assert sum(p.shard_rows(o) for o in range(parts)) == rows
    for o in range(parts):
        mine = slot[owner == o]
        assert sorted(mine.tolist()) == list(range(p.shard_rows(o)))
        assert torch.equal(p.global_ids(o, mine), ids[owner == o])


@pytest.mark.unit
def test_hash_partition_spreads_hot_neighbours():
    owners = HashPartition(1_000_000, 2).owner(torch.arange(1000))
    assert abs(int((owners == 0).sum()) - 500) <= 5


@pytest.mark.unit
def test_initial_values_depend_only_on_seed_and_id():
    a = hash_uniform(torch.tensor([3, 7, 11]), 8, seed=1, low=-1, high=1)
    b = hash_uniform(torch.tensor([11, 3]), 8, seed=1, low=-1, high=1)
    assert torch.equal(a[[2, 0]], b)
    assert not torch.equal(a, hash_uniform(torch.tensor([3, 7, 11]), 8, seed=2, low=-1, high=1))
    assert float(a.min()) >= -1 and float(a.max()) < 1 and float(a.std()) > 0.3


def _tier_with_rows(rows=10, width=2):
    tier = HostTier(rows, width)
    tier.fill(lambda start, stop: torch.arange(start, stop, dtype=torch.float32).view(-1, 1).repeat(1, width))
    return tier


@pytest.mark.unit
def test_lru_cache_evicts_least_recent_and_writes_back():
    tier = _tier_with_rows()
    cache = RowCache(tier, capacity=3)
    cache.fetch(torch.tensor([0, 1, 2]))
    cache.store(torch.tensor([0]), torch.full((1, 2), 100.0))
    cache.fetch(torch.tensor([1]))
    cache.fetch(torch.tensor([2]))
    cache.fetch(torch.tensor([5]))  # evicts 0, the least recently used, writing it back
    assert float(tier.data[0, 0]) == 100.0
    assert cache.stats.evictions == 1 and cache.stats.bytes_to_tier == 8
    assert int(cache.slot_of[0]) == -1 and int(cache.slot_of[5]) >= 0
    assert cache.stats.hits == 2 and cache.stats.misses == 4


@pytest.mark.unit
def test_lfu_cache_keeps_frequent_rows():
    cache = RowCache(_tier_with_rows(), capacity=2, policy="lfu")
    for _ in range(3):
        cache.fetch(torch.tensor([4]))
    cache.fetch(torch.tensor([6]))
    cache.fetch(torch.tensor([7]))  # 6 (used once) goes, 4 (used thrice) stays
    assert int(cache.slot_of[4]) >= 0 and int(cache.slot_of[6]) == -1


@pytest.mark.unit
def test_cache_smaller_than_a_batch_bypasses_to_the_tier():
    tier = _tier_with_rows()
    cache = RowCache(tier, capacity=2)
    rows = torch.tensor([1, 3, 5, 7])
    assert torch.equal(cache.fetch(rows)[:, 0], rows.float())
    cache.store(rows, torch.zeros(4, 2))
    cache.flush()
    assert float(tier.data[rows].abs().sum()) == 0.0
    assert cache.stats.bytes_bypass > 0


@pytest.mark.unit
def test_disk_tier_reads_what_it_wrote(tmp_path):
    tier = DiskTier(6, 3, tmp_path / "shard.f32")
    tier.fill(lambda start, stop: torch.ones(stop - start, 3))
    tier.write(torch.tensor([4, 1]), torch.tensor([[1.0, 2, 3], [4, 5, 6]]))
    tier.trim()
    assert torch.equal(tier.read(torch.tensor([1, 4, 0])),
                       torch.tensor([[4.0, 5, 6], [1, 2, 3], [1, 1, 1]]))
    tier.close()
    assert not (tmp_path / "shard.f32").exists()


@pytest.mark.unit
def test_a_row_cache_is_built_in_front_of_the_disk_tier_only_on_the_cpu(tmp_path, caplog):
    """In front of the host tier a CPU cache would only copy rows within the same memory."""
    def table(tier):
        options = StoreOptions(tier=tier, disk_dir=tmp_path, cache_rows=4, cache_policy="lfu", device="cpu")
        return ShardedTable("t", 10, 2, RowSGD(lr=0.1), options, member=0, members=1)

    with caplog.at_level("INFO", logger="hvps"):
        host = table("host")
    assert host.cache is None and host.cache_state == "bypassed: host tier"
    assert "no row cache" in caplog.text and host.memory()["cache_bytes"] == 0
    disk = table("disk")
    assert isinstance(disk.cache, RowCache) and disk.cache_state == "lfu"
    discard_tier(disk.tier)


@pytest.mark.unit
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_row_optimizers_equal_dense_torch_bit_for_bit(name):
    """Rows not in the batch: dense torch leaves them as they are, so row-wise = dense."""
    torch.manual_seed(0)
    weight = torch.randn(5, 4)
    param = torch.nn.Parameter(weight.clone())
    reference = torch.optim.SGD([param], lr=0.3) if name == "sgd" else torch.optim.Adagrad([param], lr=0.3, lr_decay=0.1)
    rows = make_optimizer({"name": name, "lr": 0.3, **({"lr_decay": 0.1} if name == "adagrad" else {})})
    records = torch.cat([weight, torch.zeros(5, 4 * rows.state_width)], dim=1)
    for step in range(3):
        touched = torch.tensor([0, 3]) if step % 2 == 0 else torch.tensor([1, 3])
        grad = torch.zeros(5, 4)
        grad[touched] = torch.randn(2, 4)
        param.grad = grad
        reference.step()
        rows.begin_step()
        records[touched] = rows.step(records[touched], grad[touched], 4)
    assert torch.equal(records[:, :4], param.detach())


@pytest.mark.unit
def test_row_adam_matches_sparse_adam():
    torch.manual_seed(1)
    emb = torch.nn.Embedding(6, 3, sparse=True)
    reference = torch.optim.SparseAdam(list(emb.parameters()), lr=0.05)
    opt = RowAdam(lr=0.05)
    records = torch.cat([emb.weight.detach().clone(), torch.zeros(6, 6)], dim=1)
    for step in range(4):
        ids = torch.tensor([step % 5, 5])
        emb(ids).sum().backward()
        reference.step()
        reference.zero_grad()
        opt.begin_step()
        records[ids] = opt.step(records[ids], torch.ones(2, 3), 3)
    torch.testing.assert_close(records[:, :3], emb.weight.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.unit
def test_optimizer_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown row optimizer"):
        make_optimizer("lamb")
    with pytest.raises(ValueError, match="lr"):
        RowSGD(lr=0)
    with pytest.raises(ValueError, match="betas"):
        RowAdam(betas=(1.0, 0.9))
    assert isinstance(make_optimizer(RowAdagrad(lr=1.0)), RowAdagrad)
    assert math.isclose(make_optimizer("adam", lr=0.2).lr, 0.2)


@pytest.mark.unit
def test_gather_pays_for_small_steps_at_small_member_counts_only():
    """recsys.py's sizes: 64 floats a row, 66 a gradient row; ~190 or ~1,200 distinct ids a member."""
    assert gather_pays([190] * 2, [190] * 2, 64, 64, 66)
    assert gather_pays([400, 0], [0, 300], 64, 64, 66)  # a member with no ids
    assert not gather_pays([1200] * 2, [1200] * 2, 64, 64, 66)
    assert not gather_pays([190] * 8, [190] * 8, 64, 64, 66)
    assert not gather_pays([190] * 2, [3000] * 2, 64, 3 * 64, 66)  # Adam's records: 3x the rows back


@pytest.mark.unit
@pytest.mark.parametrize("depth,staleness", [(0, 0), (3, 0), (2, 1)])
def test_prefetch_depth_is_checked(depth, staleness):
    with pytest.raises(ValueError, match="prefetch_depth must be 1, or 2 with staleness=0"):
        ShardedEmbeddingBag(10, 4, name="deep", prefetch_depth=depth, staleness=staleness)


def _store_case(np_, backend):
    env = {"HVPS_DYNAMIC_PROCESS_SETS": "1", "HVPS_BACKEND": backend}
    return [(np_, case(f"store-{backend}", "mpi_store.py", env=env, timeout=240))]


@pytest.mark.inner_cases(cases=_store_case, share=SHARED_JOBS)
@pytest.mark.parametrize("np_,backend", [(2, "mpi"), (3, "mpi"), (2, "tdist")], ids=["np2", "np3", "np2-tdist"])
def test_store_multirank(np_, backend, inner_results):
    """tests/mpi/mpi_store.py: bit-exact SGD vs nn.EmbeddingBag/nn.Embedding on the global batch,
    Adagrad/Adam vs torch, prefetch (synchronous and with staleness), staleness, bad input, config mismatch, checkpoint re-sharding and fallback
    (and once on the torch.distributed data plane: the store only uses hvps's alltoall)."""
    inner_results[f"store-{backend}"].assert_all_passed(min_passed=23)
