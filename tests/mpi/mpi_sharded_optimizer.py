"""Inner multi-rank tests of ``ShardedOptimizer`` (ZeRO stage 1-2): against single-process training on the
global batch, computed in-process on every rank without hvps.

Bit-exactness needs gradients whose average is exact. The dyadic model's loss is linear in its outputs
(``sum(head(x) * t)`` over three heads, small-integer data, dyadic weights), so its gradients do not depend
on the parameters and are small multiples of 1/64: exact in float32, summed in any order. Each rank's loss
is its part of the global loss times N, so the Average reduce-scatter divides an exact multiple of N by N
(exact too) and yields the reference's gradient bit for bit. Both sides use ``foreach=False`` (element-wise
kernels): the shard update then computes every element as the unsharded optimizer does.

The model has 56 parameters (not a multiple of 3) in two parameter groups with different rates; with a
bucket cap of 20 floats it has four buckets of 18, 28, 7 and 3 elements, two of them uneven at 3 ranks. The local
optimizer steps each rank's block in chunks of 5 floats here (``STEP_CHUNK_BYTES``, 1 MiB in use), so that most
blocks span several chunks and a chunk ends inside a parameter (the disk tier keeps one chunk per bucket).
"""

import pytest
import torch

import hvps.adapters.torch as hvd
from hvps import HvpsError
from hvps.adapters.torch import sharded_optimizer
from hvps.adapters.torch.sharded_optimizer import ShardedOptimizer
from hvps_testutil import assert_same_optimizer_state, dyadic

pytestmark = pytest.mark.timeout(120)

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and, per rank, by 2 micro-batches
STEPS = 4
SCALE = 2.0 ** -6
HEADS = [(5, 3, True), (4, 7, True), (3, 1, False)]  # (inputs, outputs, bias): 18 + 35 + 3 = 56 parameters
TINY_BUCKETS = 20 * 4 / 2**20  # 20 float32 elements


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    chunk, sharded_optimizer.STEP_CHUNK_BYTES = sharded_optimizer.STEP_CHUNK_BYTES, 5 * 4
    yield
    sharded_optimizer.STEP_CHUNK_BYTES = chunk


class Heads(torch.nn.Module):
    """Three linear heads on slices of the input; the loss ``sum(head(x) * t)`` is linear in the outputs."""

    def __init__(self):
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=b) for i, o, b in HEADS)

    def loss(self, x, targets, factor):
        total, start = 0, 0
        for head, t in zip(self.heads, targets):
            total = total + (head(x[:, start : start + head.in_features]) * t).sum()
            start += head.in_features
        return total * factor


def _model():
    torch.manual_seed(11)
    return dyadic(Heads())


def _data(step):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(-4, 5, (GLOBAL_BATCH, sum(i for i, _, _ in HEADS)), generator=g).float()
    targets = [torch.randint(-4, 5, (GLOBAL_BATCH, o), generator=g).float() for _, o, _ in HEADS]
    return x, targets


def _local(x, targets, micro=None):
    per = GLOBAL_BATCH // hvd.size()
    lo = hvd.rank() * per
    rows = slice(lo, lo + per) if micro is None else slice(lo + micro * per // 2, lo + (micro + 1) * per // 2)
    return x[rows], [t[rows] for t in targets]


def _groups(model, kind, lr):
    heads = model.heads
    first = [*heads[0].parameters(), *heads[1].parameters()]
    groups = [{"params": first}, {"params": list(heads[2].parameters()), "lr": lr * 2}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.5, weight_decay=2.0 ** -5, foreach=False)
    return torch.optim.Adam(groups, lr=lr, foreach=False)


def _reference_step(model, opt, step):
    opt.zero_grad()
    x, targets = _data(step)
    model.loss(x, targets, SCALE).backward()
    opt.step()


def _sharded_step(model, opt, step, passes=1):
    opt.zero_grad()
    x, targets = _data(step)
    for micro in range(passes):
        xs, ts = _local(x, targets, None if passes == 1 else micro)
        model.loss(xs, ts, SCALE * hvd.size()).backward()
    opt.step()


def _assert_equal(model, ref, what):
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), f"{what}: {name} differs from the single-process run by {(a - b).abs().max()}"


@pytest.mark.parametrize("buckets", ["one", "tiny"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_bit_identical_to_one_process(kind, buckets):
    lr = 2.0 ** -4
    ref, model = _model(), _model()
    ref_opt = _groups(ref, kind, lr)
    cap = TINY_BUCKETS if buckets == "tiny" else 25
    opt = ShardedOptimizer(_groups(model, kind, lr), named_parameters=model.named_parameters(), bucket_cap_mb=cap)
    assert len(opt._buckets) == (4 if buckets == "tiny" else 2)  # a bucket never spans two groups
    assert max(len(b.chunks) for b in opt._buckets) > 1
    for step in range(STEPS):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step)
        _assert_equal(model, ref, f"{kind}, step {step}")
    assert_same_optimizer_state(opt.state_dict(), ref_opt.state_dict())
    for b, entry in opt.local_state().items():  # a bucket's state is one tensor, its chunks' states views of it
        last = opt.shard_optimizer.state[opt._buckets[b].chunks[-1]]
        for key, value in entry.items():
            if value.dim() > 0:
                assert value.untyped_storage().data_ptr() == last[key].untyped_storage().data_ptr(), (b, key)


def test_backward_passes_per_step_accumulates_locally():
    ref, model = _model(), _model()
    ref_opt = _groups(ref, "adam", 2.0 ** -4)
    opt = ShardedOptimizer(_groups(model, "adam", 2.0 ** -4), named_parameters=model.named_parameters(),
                           backward_passes_per_step=2, bucket_cap_mb=TINY_BUCKETS)
    for step in range(2):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step, passes=2)
        _assert_equal(model, ref, f"two passes, step {step}")


def test_state_dict_reloads_and_continues_exactly():
    ref, model = _model(), _model()
    ref_opt = _groups(ref, "adam", 2.0 ** -4)
    opt = ShardedOptimizer(_groups(model, "adam", 2.0 ** -4), bucket_cap_mb=TINY_BUCKETS)
    for step in range(2):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step)
    saved = opt.state_dict()
    # a fresh optimizer (another bucket layout, too) continues from the consolidated state
    model = _model()
    model.load_state_dict(ref.state_dict())
    fresh = ShardedOptimizer(_groups(model, "adam", 1.0), named_parameters=model.named_parameters())
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["lr"] == 2.0 ** -4
    for step in range(2, 4):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, fresh, step)
        _assert_equal(model, ref, f"reloaded, step {step}")
    # the consolidated state loads into the unsharded optimizer too
    plain = _groups(_model(), "adam", 1.0)
    plain.load_state_dict(fresh.state_dict())
    assert_same_optimizer_state(plain.state_dict(), ref_opt.state_dict())


def _state_bytes(optimizer):
    storages = {}
    for entry in optimizer.state.values():
        for value in entry.values():
            if torch.is_tensor(value):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def test_optimizer_state_is_one_nth(monkeypatch):
    monkeypatch.setattr(sharded_optimizer, "STEP_CHUNK_BYTES", 1 << 20)  # the default: one chunk per bucket here
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.Tanh(), torch.nn.Linear(97, 31))
    ref = torch.nn.Sequential(torch.nn.Linear(64, 97), torch.nn.Tanh(), torch.nn.Linear(97, 31))
    replicated = torch.optim.Adam(ref.parameters(), foreach=False)
    opt = ShardedOptimizer(torch.optim.Adam(model.parameters(), foreach=False), bucket_cap_mb=0.01)
    x = torch.randn(4, 64)
    for m, o in ((ref, replicated), (model, opt)):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    numel = sum(p.numel() for p in model.parameters())
    elements = sum(b.shard_numel for b in opt._buckets)
    assert elements * hvd.size() - numel < hvd.size() * len(opt._buckets)  # padding only
    mine, full = _state_bytes(opt.shard_optimizer), _state_bytes(replicated)
    steps = 4 * sum(len(b.chunks) for b in opt._buckets)  # one float32 step count per chunk
    assert mine == 2 * 4 * elements + steps
    assert mine <= full / hvd.size() * 1.02, (mine, full)
    # after the step no rank keeps a full gradient: only its shard of the averaged one, freed by the step
    assert all(p.grad is None for p in model.parameters())


def test_fp16_compression_is_close():
    torch.manual_seed(5)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           named_parameters=model.named_parameters(), compression=hvd.Compression.fp16)
    g = torch.Generator().manual_seed(9)
    for step in range(3):
        x = torch.randn(GLOBAL_BATCH, 8, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        opt.zero_grad()
        xs, _ = _local(x, [])
        model(xs).square().mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_parameters_that_differ_across_ranks_are_named():
    last = hvd.size() - 1
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3 if hvd.rank() != last else 2))
    with pytest.raises(HvpsError) as caught:
        ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    message = str(caught.value)
    assert "'1.weight'" in message and "rank 0" in message and f"rank {last}" in message, message


def test_sparse_gradient_is_refused_unless_dense():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    opt = ShardedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1),
                           named_parameters=embedding.named_parameters())
    with pytest.raises(ValueError, match="'weight' has a sparse gradient"):
        embedding(torch.tensor([1, 2])).sum().backward()
    opt.reset_step()
    torch.manual_seed(2)  # the same rows on every rank (no broadcast here)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    dense = ShardedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.5), sparse_as_dense=True)
    before = embedding.weight.detach().clone()
    embedding(torch.tensor([1, 2])).sum().backward()
    dense.step()
    moved = (embedding.weight != before).any(dim=1)
    assert moved.tolist() == [False, True, True] + [False] * 7


def test_horovods_start_up_idiom_works_on_a_fresh_optimizer():
    """``broadcast_parameters`` and ``broadcast_optimizer_state`` right after wrapping, as Horovod scripts do:
    the state is empty then, so the root's ``state_dict()`` needs no collective of its own."""
    torch.manual_seed(hvd.rank())  # different on every rank until broadcast
    model = torch.nn.Linear(5, 3)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (hvd.rank() + 1), foreach=False),
                                   named_parameters=model.named_parameters(), shard=True)
    assert isinstance(opt, ShardedOptimizer)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == 0.01
    model(torch.ones(2, 5) * hvd.rank()).sum().backward()
    opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.reshape(1, -1))
    assert all(torch.equal(row, flat) for row in gathered)
    # once there is state, the consolidated state_dict() is collective: every rank takes part, none hangs
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()["state"]
    moments = torch.cat([state[i]["exp_avg"].reshape(-1) for i in sorted(state)])
    assert all(torch.equal(row, moments) for row in hvd.allgather(moments.reshape(1, -1)))


def test_clip_grad_norm_clips_the_whole_gradient():
    torch.manual_seed(4)
    ref = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=TINY_BUCKETS)
    x = torch.randn(GLOBAL_BATCH, 7, generator=torch.Generator().manual_seed(1))
    ref(x).square().mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    model(_local(x, [])[0]).square().mean().backward()
    with pytest.raises(HvpsError, match="synchronize"):
        opt.clip_grad_norm_(0.05)
    opt.synchronize()
    norm = opt.clip_grad_norm_(0.05)
    with opt.skip_synchronize():
        opt.step()
    assert expected > 0.05
    torch.testing.assert_close(norm.float(), expected, rtol=1e-5, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("wrapper", ["replicated", "sharded"])
def test_step_after_synchronize_without_skip_warns_and_reduces_once(wrapper):
    """Horovod's contract for both torch wrappers: ``synchronize()`` then ``step()`` outside ``skip_synchronize()``
    reduces the gradients once (the step matches plain SGD on the global batch) and warns at the caller's line."""
    torch.manual_seed(5)
    ref = torch.nn.Linear(7, 3)
    model = torch.nn.Linear(7, 3)
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = (hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters()) if wrapper == "replicated"
           else ShardedOptimizer(inner, bucket_cap_mb=TINY_BUCKETS))
    x = torch.randn(GLOBAL_BATCH, 7, generator=torch.Generator().manual_seed(6))
    ref(x).square().mean().backward()
    ref_opt.step()
    model(_local(x, [])[0]).square().mean().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="reduced once only") as caught:
        opt.step()
    assert {w.filename for w in caught} == {__file__}
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _expected_flat(consolidated, bucket, key, lo, hi):
    """Elements [lo, hi) of bucket ``bucket`` (a layout entry) of ``key``, from the consolidated state (zero padded)."""
    flat = torch.cat([consolidated["state"][index][key].reshape(-1) for index, _, _ in bucket["params"]])
    out = torch.zeros(hi - lo, dtype=flat.dtype)
    stop = min(hi, flat.numel())
    if stop > lo:
        out[: stop - lo] = flat[lo:stop]
    return out


def _two_adam_steps_saved(directory, lr):
    """A reference Adam and a ShardedOptimizer, two identical steps each, the sharded one saved as epoch 1 in
    ``directory``: ``(ref, ref_opt, model, opt, manager)``."""
    ref, model = _model(), _model()
    ref_opt = _groups(ref, "adam", lr)
    opt = ShardedOptimizer(_groups(model, "adam", lr), named_parameters=model.named_parameters(),
                           bucket_cap_mb=TINY_BUCKETS)
    for step in range(2):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step)
    mgr = hvd.CheckpointManager(directory, fsync=False)
    mgr.save(1, model=model, optimizer=opt)
    return ref, ref_opt, model, opt, mgr


def test_checkpoint_shards_reload_at_any_rank_count_and_into_one_process(shared_dir):
    """Issue 39, item 4: saved as per-rank shards plus a manifest; loaded at this rank count (another bucket
    layout), into a plain torch Adam (consolidated, as one process would) and, emulated, at 1 to 4 ranks:
    each continues bit-identically / holds exactly the consolidated state's slice."""
    import h5py

    from hvps.adapters.torch import sharded_checkpoint as sc
    from hvps.checkpoint.resharding import shard_bounds

    lr = 2.0 ** -4
    directory = shared_dir / "sharded-optimizer-ckpt"
    ref, ref_opt, model, opt, mgr = _two_adam_steps_saved(directory, lr)
    consolidated = opt.state_dict()
    assert_same_optimizer_state(consolidated, ref_opt.state_dict())
    # this rank's file holds its shard only: 1/N of the element-wise state
    with h5py.File(directory / "optim-epoch-000001" / sc.shard_file_name(hvd.rank(), hvd.size())) as f:
        stored = sum(f["optimizer"][b][k].size for b in f["optimizer"] for k in f["optimizer"][b])
    assert stored == 2 * sum(b.shard_numel for b in opt._buckets)

    # the same rank count, another bucket layout: bit-identical continuation
    model2 = _model()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    opt2 = ShardedOptimizer(_groups(model2, "adam", 1.0), named_parameters=model2.named_parameters())
    assert mgr.load(model=model2, optimizer=opt2) == 2
    assert opt2.param_groups[0]["lr"] == lr
    # into one plain torch Adam (every rank consolidates, reading every shard)
    plain_model = _model()
    plain = _groups(plain_model, "adam", 1.0)
    assert mgr.load(model=plain_model, optimizer=plain) == 2
    assert_same_optimizer_state(plain.state_dict(), consolidated)
    for step in range(2, 4):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model2, opt2, step)
        _reference_step(plain_model, plain, step)
        _assert_equal(model2, ref, f"reloaded at {hvd.size()} ranks, step {step}")
        _assert_equal(plain_model, ref, f"reloaded into one process, step {step}")

    # other rank counts, emulated on every rank: rank q of M reads its ranges of the N saved shards
    layout = opt.shard_layout()
    for size in range(1, 5):
        other = sc.relayout(layout, size)
        for q in range(hvd.rank(), size, hvd.size()):
            staged = sc.stage_shard(directory, mgr.loaded, other, q)
            for b, bucket in enumerate(other["buckets"]):
                lo, hi = shard_bounds(bucket["numel"], size, q)
                for key in ("exp_avg", "exp_avg_sq"):
                    expected = _expected_flat(consolidated, bucket, key, lo, hi)
                    assert torch.equal(staged[b][key], expected), (size, q, b, key)
                first = bucket["params"][0][0]
                assert torch.equal(staged[b]["step"], consolidated["state"][first]["step"])


def test_disk_tier_trains_bit_identically_and_checkpoints(shared_dir):
    """Issue 39, item 3: with the shards' Adam state in each rank's disk tier, training is bit-identical to
    one process; the sharded checkpoint reads the tiered state as it reads in-memory state, and a tiered
    optimizer loads it back into its tier and continues bit-identically."""
    lr = 2.0 ** -4
    tier_dir = shared_dir / f"state-tier-rank{hvd.rank()}"
    ref, model = _model(), _model()
    ref_opt = _groups(ref, "adam", lr)
    opt = ShardedOptimizer(_groups(model, "adam", lr), named_parameters=model.named_parameters(),
                           bucket_cap_mb=TINY_BUCKETS, state_tier="disk", disk_dir=tier_dir)
    for step in range(2):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step)
        _assert_equal(model, ref, f"disk tier, step {step}")
    tiered = [v for entry in opt.local_state().values() for v in entry.values() if v.dim() > 0]
    assert tiered and all(opt.state_tier.holds(v) for v in tiered)
    assert list(tier_dir.iterdir()) == []  # scratch files have no name
    mgr = hvd.CheckpointManager(shared_dir / "state-tier-ckpt", fsync=False)
    mgr.save(1, model=model, optimizer=opt)
    model2 = _model()
    opt2 = ShardedOptimizer(_groups(model2, "adam", lr), named_parameters=model2.named_parameters(),
                            state_tier="disk", disk_dir=tier_dir)
    assert mgr.load(model=model2, optimizer=opt2) == 2  # the epoch to start
    assert all(opt2.state_tier.holds(v) for entry in opt2.local_state().values() for v in entry.values()
               if v.dim() > 0)
    for step in range(2, 4):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model2, opt2, step)
        _assert_equal(model2, ref, f"disk tier reloaded, step {step}")
    assert_same_optimizer_state(opt2.state_dict(), ref_opt.state_dict())
    opt.close()
    opt2.close()


def test_checkpoint_reloads_at_one_rank_fewer_and_continues_exactly(shared_dir):
    """Saved at N ranks, loaded by a ShardedOptimizer over N - 1 of them (a real re-shard, N -> N - 1) while
    the rank left out loads it into a plain Adam: both continue bit-identically to one process."""
    import hvps

    fewer = hvd.size() - 1
    lr = 2.0 ** -4
    ref, ref_opt, model, opt, mgr = _two_adam_steps_saved(shared_dir / "sharded-optimizer-fewer", lr)
    subset = hvps.add_process_set(list(range(fewer)))
    try:
        model2 = _model()
        inside = hvd.rank() < fewer
        if inside:
            opt2 = ShardedOptimizer(_groups(model2, "adam", 1.0), named_parameters=model2.named_parameters(),
                                    bucket_cap_mb=TINY_BUCKETS * 2, process_set=subset)
        else:
            opt2 = _groups(model2, "adam", 1.0)
        assert mgr.load(model=model2, optimizer=opt2) == 2
        for step in range(2, 4):
            _reference_step(ref, ref_opt, step)
            if inside:
                opt2.zero_grad()
                x, targets = _data(step)
                per = GLOBAL_BATCH // fewer
                rows = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
                model2.loss(x[rows], [t[rows] for t in targets], SCALE * fewer).backward()
                opt2.step()
            else:
                _reference_step(model2, opt2, step)
            _assert_equal(model2, ref, f"{hvd.size()} -> {fewer if inside else 'one process'}, step {step}")
    finally:
        hvps.remove_process_set(subset)


def test_elastic_state_restores_a_commit_and_rebuilds_a_rank_from_its_neighbours_copy():
    """Issue 39 item 5 at stage 1-2, on real ranks without killing one: TorchState over the model and a
    ShardedOptimizer (Adam, tiny buckets). A restore undoes an uncommitted step; then rank 1 forgets its Adam
    shards and its save no longer matches the others', as a worker that replaced a dead one would: the sync
    rebuilds them from its ring neighbour's copy, and the next steps are bit-exact the one-process run."""
    from hvps.adapters.torch.elastic_sharding import ShardedOptimizerStateHandler

    lr = 2.0 ** -4
    ref, model = _model(), _model()
    ref_opt = _groups(ref, "adam", lr)
    opt = ShardedOptimizer(_groups(model, "adam", lr), named_parameters=model.named_parameters(),
                           bucket_cap_mb=TINY_BUCKETS)
    state = hvd.elastic.TorchState(model, opt, batch=0)
    assert isinstance(state._handlers["optimizer"], ShardedOptimizerStateHandler)
    assert not state.same_on_every_rank
    state.sync()
    for step in range(2):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step)
        state.batch += 1
        state.commit()
    _sharded_step(model, opt, 2)
    state.restore()
    _assert_equal(model, ref, "after a restore")
    if hvd.rank() == 1:
        handler = state._handlers["optimizer"]
        handler._saved.version = -1  # not the save the others hold: rank 1 contributes nothing
        handler._saved.blocks = [block * 0 for block in handler._saved.blocks]
        opt.shard_optimizer.state.clear()
    state.sync()
    assert state.batch == 2
    for step in range(2, 4):
        _reference_step(ref, ref_opt, step)
        _sharded_step(model, opt, step)
        _assert_equal(model, ref, f"step {step} after the rebuild")
    assert_same_optimizer_state(opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_replicated_runs_checkpoint_loads_into_a_sharded_optimizer_and_continues_exactly(shared_dir, kind):
    """Issue 39 item 4, the migration from replication: a run with ``hvd.DistributedOptimizer`` saves a dense
    checkpoint; a ShardedOptimizer (tiny buckets, uneven over 3 ranks) loads it, each rank keeping its slice of
    every bucket, and continues bit for bit as the uninterrupted replicated run."""
    from hvps_testutil import replicated_checkpoint, shifted

    lr = 2.0 ** -4
    replicated = _model()

    def two_steps(opt):
        for step in range(2):
            _sharded_step(replicated, opt, step)

    replicated_opt, mgr = replicated_checkpoint(replicated, _groups(replicated, kind, lr), two_steps,
                                                shared_dir / f"replicated-to-sharded-{kind}")
    model = shifted(_model())
    opt = ShardedOptimizer(_groups(model, kind, 1.0), named_parameters=model.named_parameters(),
                           bucket_cap_mb=TINY_BUCKETS)
    assert mgr.load(model=model, optimizer=opt) == 2
    assert opt.param_groups[0]["lr"] == lr
    for step in range(2, 4):
        _sharded_step(replicated, replicated_opt, step)
        _sharded_step(model, opt, step)
        _assert_equal(model, replicated, f"replicated -> sharded at {hvd.size()} ranks, {kind}, step {step}")
    assert_same_optimizer_state(opt.state_dict(), replicated_opt.state_dict())
