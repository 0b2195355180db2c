"""Inner multi-rank tests of hvps.store: the sharded tables against single-process torch on the
global batch (every rank regenerates every rank's data and computes the reference itself).

Bit-for-bit comparisons draw the upstream gradients from a dyadic grid (multiples of 1/64 in
[-1, 1)): torch's CPU embedding-bag backward adds one id's gradient rows in the order of an
*unstable* sort of the whole global batch, which no sharded implementation can know, and on
that grid every order gives the same sum.  Everything else (weights, pooling, routing, dedup,
the optimizer's arithmetic) is full precision.  Full-precision gradients are compared with
``combine="ordered"`` against batch-order accumulation (bit-for-bit) and with the default
combine against torch within float tolerance.
"""

import warnings

import h5py
import pytest
import torch
import torch.nn.functional as F
from hvps_testutil import shared_dir
from torch import nn

import hvps
import hvps.adapters.torch as hvd
from hvps.checkpoint.manager import CheckpointManager
from hvps.store import ShardedEmbedding, ShardedEmbeddingBag, load_stores, save_stores

pytestmark = pytest.mark.timeout(120)

N, D, LR, STEPS = 61, 16, 0.5, 4


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _initial():
    return torch.randn(N, D, generator=torch.Generator().manual_seed(5))


def _from(weight):
    return lambda ids, dim: weight[ids]


def _cached(rows, directory):
    """A row cache of ``rows`` (none for 0): on the disk tier, in front of which a table builds
    one on the CPU (in front of the host tier it would only copy rows; hvps/store/table.py)."""
    return {"cache_rows": rows, "tier": "disk", "disk_dir": directory} if rows else {}


def _grads(g, rows, dyadic):
    if dyadic:
        return torch.randint(-64, 64, (rows, D), generator=g).float() / 64
    return torch.randn(rows, D, generator=g)


def _rank_batch(g, rank, mode, dyadic):
    """(input, offsets, upstream gradient) of one rank: skewed ids, uneven batch sizes."""
    bags = 2 + rank
    if mode == "mean":  # fixed bags of 4: the mean's 1/4 is exact
        ids = (torch.randint(0, N, (bags, 4), generator=g) ** 2) % N
        return ids, None, _grads(g, bags, dyadic)
    sizes = torch.randint(0, 5, (bags,), generator=g)  # empty bags included
    ids = (torch.randint(0, N, (int(sizes.sum()),), generator=g) ** 2) % N
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
    return ids, offsets, _grads(g, bags, dyadic)


def _global(batches):
    """The concatenation of every rank's batch, as one single-process batch."""
    ids = torch.cat([b[0] for b in batches])
    grads = torch.cat([b[2] for b in batches])
    if batches[0][1] is None:
        return ids, None, grads
    offsets, base = [], 0
    for b in batches:
        offsets.append(b[1] + base)
        base += b[0].numel()
    return ids, torch.cat(offsets), grads


def _step_data(step, mode, dyadic, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + 17 * step + hvd.size())
    batches = [_rank_batch(g, r, mode, dyadic) for r in range(hvd.size())]
    return batches[hvd.rank()], _global(batches)


def _full_table(module):
    """The whole table assembled from every member's shard (small tables only)."""
    module.synchronize()
    t = module.table
    t.flush()
    ids = t.partition.global_ids(t.member, torch.arange(t.tier.rows))
    weights = t.records(0, t.tier.rows)[:, : t.dim].clone()
    all_ids = hvd.allgather(ids, process_set=module.process_set)
    all_weights = hvd.allgather(weights, process_set=module.process_set)
    full = torch.full((t.num_embeddings, t.dim), float("nan"))
    full[all_ids] = all_weights
    return full


def _local_slice(global_out, mine_rows):
    before = sum(2 + r for r in range(hvd.rank()))
    return global_out[before: before + mine_rows]


def _train_pair(module, reference, ref_opt, mode, dyadic, salt=0, steps=STEPS, prefetch=False):
    """Train both side by side; returns the largest forward difference seen.

    ``prefetch``: each step's batch is prefetched right after the previous forward."""
    worst = 0.0
    for step in range(steps):
        (ids, offsets, grad), (gids, goffsets, ggrad) = _step_data(step, mode, dyadic, salt)
        out = module(ids, offsets) if offsets is not None else module(ids)
        if prefetch and step + 1 < steps:
            module.prefetch(*(b for b in _step_data(step + 1, mode, dyadic, salt)[0][:2] if b is not None))
        ref_out = reference(gids, goffsets) if goffsets is not None else reference(gids)
        mine = _local_slice(ref_out, ids.shape[0] if offsets is None else offsets.numel())
        worst = max(worst, float((out - mine).detach().abs().max()) if out.numel() else 0.0)
        (out * grad).sum().backward()
        (ref_out * ggrad).sum().backward()
        if ref_opt is not None:
            ref_opt.step()
            ref_opt.zero_grad()
    return worst


CASES = [  # mode, partition, cache rows, cache policy, tier
    ("sum", "hash", 0, "lru", "host"),
    ("sum", "range", 5, "lru", "host"),
    ("mean", "hash", 5, "lfu", "disk"),
    ("mean", "range", 0, "lru", "host"),
]


@pytest.mark.parametrize("mode,partition,cache_rows,policy,tier", CASES)
def test_bag_sgd_is_bit_exact(mode, partition, cache_rows, policy, tier, tmp_path):
    w0 = _initial()
    name = f"bag_{mode}_{partition}_{cache_rows}_{tier}"
    module = ShardedEmbeddingBag(N, D, mode=mode, name=name, lr=LR, partition=partition, cache_rows=cache_rows,
                                 cache_policy=policy, tier=tier, disk_dir=tmp_path, initializer=_from(w0))
    reference = nn.EmbeddingBag(N, D, mode=mode, _weight=w0.clone())
    worst = _train_pair(module, reference, torch.optim.SGD(reference.parameters(), lr=LR), mode, dyadic=True)
    assert worst == 0.0
    assert torch.equal(_full_table(module), reference.weight.detach())
    stats = module.stats()  # no cache in front of the host tier on the CPU: it would only copy rows
    cached = cache_rows > 0 and (tier == "disk" or torch.cuda.is_available())
    assert stats["cache"] == (policy if cached else "bypassed: host tier" if cache_rows else "none")
    assert ("hits" in stats, stats["cache_bytes"] > 0, stats.get("misses", 0) > 0) == (cached,) * 3


@pytest.mark.parametrize("mode,cache_rows", [("sum", 5), ("mean", 0)])
def test_prefetched_lookups_stay_synchronous(mode, cache_rows, tmp_path):
    """prefetch() sends the next batch's ids early; its rows still include every update."""
    w0 = _initial()
    module = ShardedEmbeddingBag(N, D, mode=mode, name=f"prefetch_{mode}", lr=LR, **_cached(cache_rows, tmp_path),
                                 initializer=_from(w0))
    reference = nn.EmbeddingBag(N, D, mode=mode, _weight=w0.clone())
    worst = _train_pair(module, reference, torch.optim.SGD(reference.parameters(), lr=LR), mode, dyadic=True,
                        salt=6, steps=5, prefetch=True)
    assert worst == 0.0
    assert torch.equal(_full_table(module), reference.weight.detach())


def test_prefetched_tables_are_answered_together_and_stay_exact(tmp_path):
    """Three tables trained in one graph with prefetch: the first forward of a step answers all
    of them (overlapping their exchanges); each still matches its own nn.EmbeddingBag."""
    w0 = _initial()
    salts = (8, 9, 10)
    modules = [ShardedEmbeddingBag(N, D, mode="sum", name=f"group{i}", lr=LR, **_cached(3 * i, tmp_path),
                                   initializer=_from(w0)) for i in range(len(salts))]
    references = [nn.EmbeddingBag(N, D, mode="sum", _weight=w0.clone()) for _ in salts]
    optimizer = torch.optim.SGD([p for r in references for p in r.parameters()], lr=LR)
    steps = 4
    for step in range(steps):
        data = [_step_data(step, "sum", dyadic=True, salt=salt) for salt in salts]
        outs = [m(ids, offsets) for m, ((ids, offsets, _), _) in zip(modules, data)]
        if step + 1 < steps:
            for m, salt in zip(modules, salts):
                ids, offsets, _ = _step_data(step + 1, "sum", dyadic=True, salt=salt)[0]
                m.prefetch(ids, offsets)
        for out, reference, ((ids, offsets, _), (gids, goffsets, _)) in zip(outs, references, data):
            mine = _local_slice(reference(gids, goffsets), offsets.numel())
            assert torch.equal(out.detach(), mine.detach()), step
        sum((out * grad).sum() for out, ((_, _, grad), _) in zip(outs, data)).backward()
        sum((r(gids, goffsets) * ggrad).sum() for r, (_, (gids, goffsets, ggrad)) in zip(references, data)).backward()
        optimizer.step()
        optimizer.zero_grad()
    for module, reference in zip(modules, references):
        assert torch.equal(_full_table(module), reference.weight.detach())


def test_prefetch_with_staleness_overlaps_the_whole_lookup(tmp_path):
    """staleness=1 + prefetch: owners answer during the previous backward, so step t reads the
    table as it was after t-1 updates (one update missing) and the final table is still exact."""
    w0 = _initial()
    module = ShardedEmbeddingBag(N, D, mode="sum", name="prefetch_stale", lr=LR, staleness=1, **_cached(4, tmp_path),
                                 initializer=_from(w0))
    weight, history = w0.clone(), [w0.clone()]
    steps = 5
    for step in range(steps):
        (ids, offsets, grad), (gids, goffsets, ggrad) = _step_data(step, "sum", dyadic=True, salt=7)
        out = module(ids, offsets)
        if step + 1 < steps:
            nids, noffsets, _ = _step_data(step + 1, "sum", dyadic=True, salt=7)[0]
            module.prefetch(nids, noffsets)
        seen = history[max(0, step - 1)]  # step 0 pulls directly; later steps miss the last update
        expected = _local_slice(F.embedding_bag(gids, seen, goffsets, mode="sum"), offsets.numel())
        assert torch.equal(out.detach(), expected), step
        out.mul(grad).sum().backward()
        bag = torch.bucketize(torch.arange(gids.numel()), goffsets, right=True) - 1
        weight.add_(torch.zeros(N, D).index_add_(0, gids, ggrad[bag]), alpha=-LR)
        history.append(weight.clone())
    assert torch.equal(_full_table(module), weight)


def _random_batch(g, width):
    """Fresh ids with many repeats (from a range of N / 3); the last rank has no ids on odd steps."""
    bags = 0 if hvd.rank() == hvd.size() - 1 and torch.randint(0, 2, (1,), generator=g).item() else 3 + hvd.rank()
    return torch.randint(0, N // 3, (bags, width), generator=g), torch.randn(bags, D, generator=g)


@pytest.mark.parametrize("optimizer,combine,mode", [("adam", "local", "sum"), ("adagrad", "ordered", "mean")])
def test_gather_and_alltoall_pushes_give_the_same_bits(optimizer, combine, mode, monkeypatch, tmp_path):
    """The push to every member (the prefetched pull answered in its message, before the update,
    and brought up to date by each member) and the push to the owners (the pull answered after
    the update) give the same outputs and the same table, bit for bit, on fresh random ids; so
    does either push with ``prefetch_depth=2`` (each batch prefetched two steps ahead, its ids
    updated by the two steps before it); the table as a checkpoint reads it (``synchronize``) in
    mid-run, with lookups prefetched, is the same too.  The prefetched ids ride in the push: a
    step makes two alltoalls (push, rows; the gather at depth 1: ids, push), one at depth 2 with
    the gather."""
    from hvps.store import exchange

    seed = int(hvd.broadcast_object(torch.seed() % 2**31, root_rank=0))
    steps, found = 5, {}
    for way, extra, depth in (("gather", float("inf"), 1), ("alltoall", -1, 1), ("gather2", float("inf"), 2),
                              ("alltoall2", -1, 2)):
        monkeypatch.setattr(exchange, "GATHER_EXTRA_BYTES", extra)
        module = ShardedEmbeddingBag(N, D, mode=mode, name=f"ways_{optimizer}_{way}", optimizer=optimizer, lr=0.1,
                                     combine=combine, **_cached(7, tmp_path), initializer=_from(_initial()),
                                     prefetch_depth=depth)
        g = torch.Generator().manual_seed(seed + hvd.rank())
        batches = [_random_batch(g, 3) for _ in range(steps)]
        outs, messages = [], []
        for step, (ids, grad) in enumerate(batches):
            out = module(ids)
            for ahead in range(step + depth if step else 1, min(step + depth, steps - 1) + 1):
                module.prefetch(batches[ahead][0])  # step 0: 1..depth; then step + depth
            (out * grad).sum().backward()
            outs.append(out.detach())
            messages.append(module.counters()["messages"])
            if step == 1:
                outs.append(_full_table(module))  # as save_stores reads it, batches 2 and 3 prefetched at depth 2
        found[way] = outs, _full_table(module), module.stats()["gathers"], messages[2] - messages[1]
    assert found["gather"][2] == found["gather2"][2] == steps - 1
    assert found["alltoall"][2] == found["alltoall2"][2] == 0
    assert [found[way][3] for way in ("gather", "alltoall", "gather2", "alltoall2")] == [2, 2, 1, 2]
    for way in ("alltoall", "gather2", "alltoall2"):
        for step, (a, b) in enumerate(zip(found["gather"][0], found[way][0])):
            assert torch.equal(a, b), f"seed {seed}: {way}, step {step}"
        assert torch.equal(found["gather"][1], found[way][1]), f"seed {seed}: {way}"


def test_prefetch_misuse_raises_value_error():
    module = ShardedEmbeddingBag(N, D, mode="sum", name="prefetch_misuse", lr=LR)
    ids = torch.tensor([[0, 1], [2, 3]])
    module.prefetch(ids)
    with pytest.raises(ValueError, match="twice"):
        module.prefetch(ids)
    with pytest.raises(ValueError, match="different batch than the one prefetched"):
        module(ids + 1)
    module(ids).sum().backward()  # the prefetched lookup still waits for its batch: every rank is in step
    deep = ShardedEmbeddingBag(N, D, mode="sum", name="prefetch_misuse2", lr=LR, prefetch_depth=2)
    deep.prefetch(ids)
    deep.prefetch(ids + 1)
    with pytest.raises(ValueError, match="3 times"):
        deep.prefetch(ids)
    with pytest.raises(ValueError, match="different batch than the one prefetched"):
        deep(ids + 1)
    deep(ids).sum().backward()  # the batches come in the order prefetched
    deep(ids + 1).sum().backward()


def test_embedding_sgd_is_bit_exact(tmp_path):
    w0 = _initial()
    module = ShardedEmbedding(N, D, name="emb", lr=LR, **_cached(7, tmp_path), initializer=_from(w0))
    reference = nn.Embedding(N, D, _weight=w0.clone())
    opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        ids = [(torch.randint(0, N, (2 + r, 3), generator=g) ** 2) % N for r in range(hvd.size())]
        grads = [_grads(g, 2 + r, True).unsqueeze(1).expand(-1, 3, -1) for r in range(hvd.size())]
        out = module(ids[hvd.rank()])
        ref_out = reference(torch.cat(ids))
        assert torch.equal(out, _local_slice(ref_out, ids[hvd.rank()].shape[0]))
        (out * grads[hvd.rank()]).sum().backward()
        (ref_out * torch.cat(grads)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(_full_table(module), reference.weight.detach())


def test_ordered_combine_follows_the_global_batch_order():
    """Full-precision gradients: the owners add each id's rows in global batch order."""
    w0 = _initial()
    module = ShardedEmbeddingBag(N, D, mode="sum", name="ordered", lr=LR, combine="ordered", initializer=_from(w0))
    weight = w0.clone()
    for step in range(STEPS):
        (ids, offsets, grad), (gids, goffsets, ggrad) = _step_data(step, "sum", dyadic=False, salt=3)
        out = module(ids, offsets)
        assert torch.equal(out, _local_slice(F.embedding_bag(gids, weight, goffsets, mode="sum"), offsets.numel()))
        out.mul(grad).sum().backward()
        bag = torch.bucketize(torch.arange(gids.numel()), goffsets, right=True) - 1
        weight.add_(torch.zeros(N, D).index_add_(0, gids, ggrad[bag]), alpha=-LR)
    assert torch.equal(_full_table(module), weight)


def test_local_combine_with_full_precision_gradients_is_close(tmp_path):
    w0 = _initial()
    module = ShardedEmbeddingBag(N, D, mode="sum", name="local_fp", lr=LR, **_cached(9, tmp_path), initializer=_from(w0))
    reference = nn.EmbeddingBag(N, D, mode="sum", _weight=w0.clone())
    _train_pair(module, reference, torch.optim.SGD(reference.parameters(), lr=LR), "sum", dyadic=False, salt=4)
    torch.testing.assert_close(_full_table(module), reference.weight.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_row_optimizers_match_torch(optimizer, tmp_path):
    w0 = _initial()
    module = ShardedEmbeddingBag(N, D, mode="mean", name=f"opt_{optimizer}", optimizer=optimizer, lr=0.1,
                                 **_cached(6, tmp_path), initializer=_from(w0))
    reference = nn.EmbeddingBag(N, D, mode="mean", sparse=optimizer == "adam", _weight=w0.clone())
    ref_opt = (torch.optim.Adagrad(reference.parameters(), lr=0.1) if optimizer == "adagrad"
               else torch.optim.SparseAdam(list(reference.parameters()), lr=0.1))
    worst = _train_pair(module, reference, ref_opt, "mean", dyadic=False, salt=5, steps=6)
    assert worst < 1e-5
    torch.testing.assert_close(_full_table(module), reference.weight.detach(), rtol=1e-5, atol=1e-5)


def test_staleness_reuses_rows_for_k_steps():
    """staleness=1: a row pulled at step s serves step s+1 unchanged, and is pulled again at s+2."""
    w0 = _initial()
    module = ShardedEmbeddingBag(N, D, mode="sum", name="stale", lr=LR, staleness=1, initializer=_from(w0))
    ids = torch.tensor([[1, 2], [3, 4]])
    outs = []
    for _ in range(3):
        out = module(ids)
        outs.append(out.detach().clone())
        out.sum().backward()
    assert torch.equal(outs[0], outs[1])  # stale: step 1's update not seen
    assert not torch.equal(outs[1], outs[2])  # refreshed: both updates seen
    stats = module.stats()
    assert stats["stale_reused"] == 4 and stats["stale_pulled"] == 8


@pytest.mark.parametrize("bad", ["float", "negative", "too_large", "bool"])
def test_bad_ids_raise_value_error_on_every_rank(bad):
    module = ShardedEmbeddingBag(N, D, mode="sum", name="strict", lr=LR)
    good = torch.tensor([[0, 1], [2, 3]])
    ids = good
    if hvd.rank() == hvd.size() - 1:
        ids = {"float": good.float(), "negative": good - 1, "too_large": good + N - 1, "bool": good > 1}[bad]
    with pytest.raises(ValueError, match="strict"):
        module(ids)
    module(good).sum().backward()  # every rank is still in step
    out = module(good)
    module.prefetch(ids)  # its ids ride in the push of this backward
    out.sum().backward()
    with pytest.raises(ValueError, match="strict"):
        module(ids)
    module(good).sum().backward()
    # its push is still in flight when the table is dropped: the next case's table of the same name must not meet
    # it (the errors' tracebacks kept this table alive until a garbage collection: DuplicateNameError)


def test_mismatched_configs_raise_hvps_error():
    with pytest.raises(hvps.HvpsError, match="configured differently"):
        ShardedEmbeddingBag(N, D + hvd.rank(), name="mismatch")
    with pytest.raises(hvps.HvpsError, match="configured differently"):
        ShardedEmbeddingBag(N, D, name="mismatch_lr", lr=0.1 * (1 + hvd.rank()))


def test_checkpoint_reshards_and_falls_back(tmp_path):
    """Save on every rank, load on a process set of another size (re-sharding), then reject a
    version whose shard is corrupt and one whose shard is missing, falling back each time."""
    size, rank = hvd.size(), hvd.rank()
    subset = hvps.add_process_set(list(range(size - 1)) if size > 2 else [0])
    try:
        directory = shared_dir("store-ckpt")
        manager = CheckpointManager(directory, keep_last=None, fsync=False)
        module = ShardedEmbeddingBag(N, D, mode="sum", name="ckpt", optimizer="adagrad", lr=0.1,
                                     **_cached(5, tmp_path))
        expected = []
        for epoch in range(3):
            _train_pair(module, nn.EmbeddingBag(N, D, mode="sum"), None, "sum", dyadic=True, salt=epoch, steps=2)
            expected.append(_full_table(module))
            save_stores(manager, epoch, [module], model={"w": torch.ones(2).numpy()})
        hvd.barrier()
        if rank == 0:
            folder = directory / "store-epoch-000002"
            shard = sorted(folder.glob("ckpt.*.h5"))[0]
            with h5py.File(shard, "r+") as f:  # one flipped value, the file still well-formed
                f["/model/records"][3, 1] += 1.0
            sorted((directory / "store-epoch-000001").glob("ckpt.*.h5"))[-1].unlink()
        hvd.barrier()
        if subset.included():
            target = ShardedEmbeddingBag(N, D, mode="sum", name="ckpt", optimizer="adagrad", lr=0.1,
                                         process_set=subset, partition="range")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = load_stores(manager, [target] if subset.included() else [])
        assert start == 1
        assert sum("skipping checkpoint epoch" in str(w.message) for w in caught) == 2
        if subset.included():
            assert target.table.partition.parts == subset.size() != size
            assert torch.equal(_full_table(target), expected[0])
            assert target.table.optimizer.steps == module.table.optimizer.steps - 4
    finally:
        hvd.barrier()
        hvps.remove_process_set(subset)
