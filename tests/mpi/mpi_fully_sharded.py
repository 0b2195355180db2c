"""Inner multi-rank tests of ``fully_shard`` (ZeRO stage 3): against single-process training on the global
batch, computed in-process on every rank without hvps, on the dyadic model of ``dyadic_heads.py`` (its gradients
are exact in float32, so the sharded run must match the one-process run bit for bit).
"""

import pytest
import torch

import hvps.adapters.torch as hvd
from hvps import HvpsError
from hvps.adapters.torch.fully_sharded import FullyShardedModel, fully_shard

import dyadic_heads as dh

pytestmark = pytest.mark.timeout(120)

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _train_side_by_side(ref, ref_opt, model, opt, steps: int, what: str) -> None:
    """``steps`` steps of the one-process reference and of the fully sharded model on this rank's part of the
    same batches; the gathered parameters must equal the reference's bit for bit after each."""
    for step in range(steps):
        x, targets = dh.data(step)
        ref_opt.zero_grad()
        ref.loss(x, targets, dh.SCALE).backward()
        ref_opt.step()
        opt.zero_grad()
        xs, ts = dh.local(x, targets)
        model.loss(xs, ts, dh.SCALE * hvd.size()).backward()
        opt.step()
        dh.assert_equal(dh.full(model), ref, f"{what}, step {step}")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_bit_identical_to_one_process(kind):
    lr = 2.0 ** -4
    ref, model = dh.model(), dh.model()
    ref_opt = dh.optimizer(ref, kind, lr)
    fully_shard(model, units=[model.first, model.second, model.first.extra])
    controller = FullyShardedModel.of(model)
    assert [u.name for u in controller.units] == ["root", "first", "first.extra", "second"]
    opt = dh.optimizer(model, kind, lr)
    _train_side_by_side(ref, ref_opt, model, opt, STEPS, kind)
    # outside forward and backward no rank holds a full parameter (they keep their shapes, not their storage)
    assert all(p.untyped_storage().nbytes() == 0 for u in controller.units for g in u.groups for p in g.full)
    assert [u.name for u in controller._forward_order] == ["root", "first", "first.extra", "second"]


class Stack(torch.nn.Module):
    """Blocks in sequence (the transformer-stack shape): prefetching in forward and backward matters."""

    def __init__(self, width=16, depth=4):
        super().__init__()
        self.embed = torch.nn.Linear(6, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width), torch.nn.Tanh())
            for _ in range(depth))
        self.head = torch.nn.Linear(width, 2)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_sequential_blocks_match_one_process_closely():
    torch.manual_seed(4)
    ref, model = Stack(), Stack()
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    fully_shard(model, units=[torch.nn.Sequential])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randn(dh.GLOBAL_BATCH, 6, generator=g)
        ref_opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        opt.zero_grad()
        model(dh.local(x, [])[0]).square().mean().backward()
        opt.step()
    full = dh.full(model)
    for name, b in ref.state_dict().items():
        torch.testing.assert_close(full[name], b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # evaluation: every unit gathered and freed again, the root too
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    assert not any(u.gathered for u in FullyShardedModel.of(model).units)


def _storage_bytes(tensors):
    storages = {}
    for t in tensors:
        if torch.is_tensor(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def _resident(model, opt):
    """Bytes of every parameter, gradient and optimizer-state storage reachable from the model and optimizer."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for entry in opt.state.values() for v in entry.values()]
    if hasattr(model, "_hvps_fully_sharded"):
        tensors += [p for u in FullyShardedModel.of(model).units for g in u.groups for p in g.full]
    return _storage_bytes(tensors)


def test_resident_bytes_are_one_nth():
    torch.manual_seed(3)
    ref, model = Stack(width=64, depth=3), Stack(width=64, depth=3)
    model.load_state_dict(ref.state_dict())
    fully_shard(model, units=[torch.nn.Sequential])
    opts = [torch.optim.Adam(m.parameters(), foreach=False) for m in (ref, model)]
    x = torch.randn(4, 6)
    for m, o in zip((ref, model), opts):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()
    mine, replicated = _resident(model, opts[1]), _resident(ref, opts[0])
    assert mine <= replicated * (1 / hvd.size() + 0.10), (mine, replicated)


def test_parameters_that_differ_across_ranks_are_named():
    last = hvd.size() - 1
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3 if hvd.rank() != last else 2))
    with pytest.raises(HvpsError) as caught:
        fully_shard(model, units=[model[0]])
    message = str(caught.value)
    assert "'1.weight'" in message and "rank 0" in message and f"rank {last}" in message, message


def test_gradients_accumulate_and_clip_over_the_whole_model():
    torch.manual_seed(6)
    ref, model = Stack(depth=2), Stack(depth=2)
    model.load_state_dict(ref.state_dict())
    fully_shard(model, units=[torch.nn.Sequential])
    x = torch.randn(dh.GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # two backward passes, no zero_grad between: the averaged gradients add up
        ref(x).square().mean().backward()
        model(dh.local(x, [])[0]).square().mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    norm = FullyShardedModel.of(model).clip_grad_norm_(0.05)
    torch.testing.assert_close(norm.float(), expected, rtol=1e-5, atol=0)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    full = dh.full(model)
    for name, b in ref.state_dict().items():
        torch.testing.assert_close(full[name], b, rtol=1e-5, atol=1e-6)


def test_elastic_state_restores_a_commit_and_rebuilds_a_rank_from_its_neighbours_copy():
    """Issue 39 item 5 on real ranks, without killing one: TorchState over a fully sharded model and its Adam.
    A restore undoes an uncommitted step (locally); then rank 1 forgets everything (its parameters, its Adam
    state, and its save no longer matches the others'), as a worker that replaced a dead one would: the sync
    rebuilds its blocks from its ring neighbour's copy, and the next steps are bit-exact the one-process run."""
    from hvps.adapters.torch.elastic_sharding import AdoptedOptimizerHandler, FullyShardedStateHandler

    lr = 2.0 ** -4
    ref, model = dh.model(), dh.model()
    ref_opt = dh.optimizer(ref, "adam", lr)
    fully_shard(model, units=[model.first, model.second])
    opt = dh.optimizer(model, "adam", lr)
    state = hvd.elastic.TorchState(model, opt, batch=0)
    assert isinstance(state._handlers["model"], FullyShardedStateHandler)
    assert isinstance(state._handlers["optimizer"], AdoptedOptimizerHandler)
    assert not state.same_on_every_rank
    state.sync()  # the same world as the save: nothing moves

    def steps(first, last, commit):
        for step in range(first, last):
            dh.sharded_steps(model, opt, step, step + 1, hvd.size(), hvd.rank())
            if commit:
                state.batch += 1
                state.commit()

    def reference_steps(first, last):
        dh.reference_steps(ref, ref_opt, first, last)

    steps(0, 2, commit=True)
    reference_steps(0, 2)
    steps(2, 3, commit=False)
    state.restore()
    dh.assert_equal(dh.full(model), ref, "after a restore")
    if hvd.rank() == 1:
        handler = state._handlers["model"]
        handler._saved.version = -1  # not the save the others hold: rank 1 contributes nothing
        handler._saved.blocks = [block * 0 for block in handler._saved.blocks]
        with torch.no_grad():
            for shard in FullyShardedModel.of(model).sharded_parameters():
                shard.zero_()
        opt.state.clear()
    state.sync()
    assert state.batch == 2
    dh.assert_equal(dh.full(model), ref, "after the rebuild")
    steps(2, 4, commit=True)
    reference_steps(2, 4)
    dh.assert_equal(dh.full(model), ref, "two Adam steps after the rebuild")


def _assert_an_optimizer_alone_loads_the_same(mgr, model, opt, kind):
    """``load(optimizer=...)`` without the model: another optimizer over the same shards gets ``opt``'s state."""
    alone = dh.optimizer(model, kind, 1.0)
    assert mgr.load(optimizer=alone) == 2
    mine, theirs = alone.state_dict(), opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert mine["state"][index].keys() == entry.keys()
        assert all(torch.equal(mine["state"][index][k], v) for k, v in entry.items()), index


def test_checkpoint_reshards_to_fewer_and_more_ranks_and_into_one_process(shared_dir):
    """Issue 39 item 4 at stage 3: saved at N ranks as per-rank shards of the parameters and of Adam's state plus a
    manifest, then loaded at N ranks with other units, at N - 1 ranks (a process set) and into an unsharded model
    with a plain Adam (every rank consolidating, as one process would): each continues bit-identically to the
    one-process run. Emulated on every rank at 1 to 4 ranks: each rank's staged blocks are exactly its slices."""
    import h5py

    import hvps
    from hvps.adapters.torch import fully_sharded_checkpoint as fc

    size, rank = hvd.size(), hvd.rank()
    lr = 2.0 ** -4
    ref, model = dh.model(), dh.model()
    ref_opt = dh.optimizer(ref, "adam", lr)
    fully_shard(model, units=[model.first, model.second])
    opt = dh.optimizer(model, "adam", lr)
    dh.sharded_steps(model, opt, 0, 2, size, rank)
    dh.reference_steps(ref, ref_opt, 0, 2)
    directory = shared_dir / "fully-sharded-ckpt"
    mgr = hvd.CheckpointManager(directory, fsync=False)
    mgr.save(1, model=model, optimizer=opt)
    with h5py.File(directory / "model-epoch-000001" / f"model.{rank:05d}-of-{size:05d}.h5") as f:
        stored = sum(f[s][g][k].size for s in ("model", "optimizer") for g in f[s] for k in f[s][g])
    assert stored == 3 * sum(g.shard_numel for g in FullyShardedModel.of(model).flat_groups())  # 1/N: values, m, v

    same = dh.model()
    with torch.no_grad():
        for p in same.parameters():
            p.add_(1.0)
    fully_shard(same, units=[same.first, same.first.extra, same.second], broadcast_from=None)  # other flat groups
    same_opt = dh.optimizer(same, "adam", 1.0)
    assert mgr.load(model=same, optimizer=same_opt) == 2
    assert same_opt.param_groups[0]["lr"] == lr
    _assert_an_optimizer_alone_loads_the_same(mgr, same, same_opt, "adam")
    fewer = size - 1
    subset = hvps.add_process_set(list(range(fewer)))
    try:
        inside = rank < fewer
        smaller = dh.model()
        if inside:
            fully_shard(smaller, units=[smaller.first, smaller.second], process_set=subset)
        smaller_opt = dh.optimizer(smaller, "adam", 1.0)
        assert mgr.load(model=smaller, optimizer=smaller_opt) == 2
        plain = dh.model()
        plain_opt = dh.optimizer(plain, "adam", 1.0)
        assert mgr.load(model=plain, optimizer=plain_opt) == 2
        for m in range(1, 5):  # rank q of M reads its ranges of the N saved shards
            for q in range(rank, m, size):
                staged = fc.stage(directory, mgr.loaded, same, same_opt, world=(m, q))
                dh.assert_staged_is_the_reference_slice(staged, same, same_opt, ref, ref_opt, m, q)
        for step in range(2, 4):
            dh.reference_steps(ref, ref_opt, step, step + 1)
            dh.sharded_steps(same, same_opt, step, step + 1, size, rank)
            if inside:
                dh.sharded_steps(smaller, smaller_opt, step, step + 1, fewer, rank)
            else:
                dh.reference_steps(smaller, smaller_opt, step, step + 1)
            dh.reference_steps(plain, plain_opt, step, step + 1)
            dh.assert_equal(dh.full(same), ref, f"reloaded at {size} ranks with other units, step {step}")
            dh.assert_equal(dh.full(smaller) if inside else smaller.state_dict(), ref,
                          f"{size} -> {fewer if inside else 'one process'}, step {step}")
            dh.assert_equal(plain.state_dict(), ref, f"{size} -> one process, step {step}")
    finally:
        hvps.remove_process_set(subset)


def test_disk_tier_under_the_shards_optimizer_is_bit_identical():
    """Issue 39, item 3 at stage 3: ``hvd.DiskStateTier`` on the plain Adam over the shard parameters keeps its
    state in a scratch file and trains bit-identically to one process."""
    import tempfile

    lr = 2.0 ** -4
    ref, model = dh.model(), dh.model()
    ref_opt = dh.optimizer(ref, "adam", lr)
    fully_shard(model, units=[model.first, model.second, model.first.extra])
    opt = dh.optimizer(model, "adam", lr)
    with tempfile.TemporaryDirectory() as directory:
        tier = hvd.DiskStateTier(opt, directory)
        _train_side_by_side(ref, ref_opt, model, opt, 3, "disk tier")
        state = [v for entry in opt.state.values() for v in entry.values() if v.dim() > 0 and v.numel() > 0]
        assert state and all(tier.holds(v) for v in state)
        tier.close()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_replicated_runs_checkpoint_loads_into_a_fully_sharded_model_and_continues_exactly(shared_dir, kind):
    """Issue 39 item 4, the migration from replication: a run with ``hvd.DistributedOptimizer`` saves a dense
    checkpoint; a fully sharded model and its optimizer load it, each rank taking its slices, and continue bit
    for bit as the uninterrupted replicated run. Emulated on every rank at 1 to 4 ranks: its staged slices."""
    from hvps_testutil import replicated_checkpoint, shifted

    from hvps.adapters.torch import fully_sharded_checkpoint as fc

    size, rank = hvd.size(), hvd.rank()
    lr = 2.0 ** -4
    replicated = dh.model()
    replicated_opt, mgr = replicated_checkpoint(
        replicated, dh.optimizer(replicated, kind, lr), lambda opt: dh.sharded_steps(replicated, opt, 0, 2, size, rank),
        shared_dir / f"replicated-to-fully-sharded-{kind}")
    model = shifted(dh.model())
    fully_shard(model, units=[model.first, model.second], broadcast_from=None)
    opt = dh.optimizer(model, kind, 1.0)
    assert mgr.load(model=model, optimizer=opt) == 2
    assert opt.param_groups[1]["lr"] == 2 * lr
    if kind == "adam":
        for m in range(1, 5):
            for q in range(rank, m, size):
                staged = fc.stage_dense(mgr.loaded, model, opt, world=(m, q))
                dh.assert_staged_is_the_reference_slice(staged, model, opt, replicated, replicated_opt, m, q)
    for step in range(2, 4):
        dh.sharded_steps(replicated, replicated_opt, step, step + 1, size, rank)
        dh.sharded_steps(model, opt, step, step + 1, size, rank)
        dh.assert_equal(dh.full(model), replicated, f"replicated -> fully sharded at {size} ranks, {kind}, step {step}")


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_sharded_optimizer_runs_checkpoint_loads_into_a_fully_sharded_model_and_continues_exactly(shared_dir,
                                                                                                    kind):
    """Issue 39 item 4, from stage 1-2 to stage 3: a ShardedOptimizer run (20-element buckets, uneven over 3 ranks)
    saves the dense model and its optimizer shards; a fully sharded model and its optimizer load it, each rank
    reading its slices of the saved shards, and continue bit for bit as the uninterrupted ShardedOptimizer run.
    Emulated on every rank at 1 to 4 ranks: its staged slices are those of the state consolidated in one process."""
    from hvps_testutil import replicated_checkpoint, shifted

    from hvps.adapters.torch import fully_sharded_checkpoint as fc

    size, rank = hvd.size(), hvd.rank()
    lr = 2.0 ** -4
    replicated = dh.model()
    sharded_opt, mgr = replicated_checkpoint(
        replicated, dh.optimizer(replicated, kind, lr), lambda opt: dh.sharded_steps(replicated, opt, 0, 2, size, rank),
        shared_dir / f"sharded-optimizer-to-fully-sharded-{kind}", shard=True, bucket_cap_mb=20 * 4 / 2**20)
    model = shifted(dh.model())
    fully_shard(model, units=[model.first, model.second], broadcast_from=None)
    opt = dh.optimizer(model, kind, 1.0)
    assert mgr.load(model=model, optimizer=opt) == 2
    assert opt.param_groups[1]["lr"] == 2 * lr
    _assert_an_optimizer_alone_loads_the_same(mgr, model, opt, kind)
    if kind == "adam":
        plain = dh.model()
        plain_opt = dh.optimizer(plain, kind, 1.0)
        assert mgr.load(model=plain, optimizer=plain_opt) == 2  # consolidated: the whole state in one process
        for m in range(1, 5):
            for q in range(rank, m, size):
                staged = fc.stage_sharded_optimizer(mgr.directory, mgr.loaded, model, opt, world=(m, q))
                dh.assert_staged_is_the_reference_slice(staged, model, opt, plain, plain_opt, m, q)
    for step in range(2, 4):
        dh.sharded_steps(replicated, sharded_opt, step, step + 1, size, rank)
        dh.sharded_steps(model, opt, step, step + 1, size, rank)
        dh.assert_equal(dh.full(model), replicated, f"ShardedOptimizer -> fully sharded at {size} ranks, {kind}, step {step}")
