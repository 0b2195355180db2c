"""ShardedOptimizer's refusals at construction (issue 39): checked before any collective, so no hvps.init here.

The multi-rank behaviour (bit-exactness, state sharding, compression, mismatched parameters) is tested in
tests/mpi/mpi_sharded_optimizer.py, inside the shared jobs of tests/test_multirank.py.
"""

import pytest
import torch

import hvps.adapters.torch as hvd
from hvps.adapters.torch.sharded_optimizer import ShardedOptimizer


def _sgd():
    return torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)


@pytest.mark.parametrize("compression, named", [
    (lambda: hvd.Compression.topk(0.1), "top"),
    (lambda: hvd.Compression.powersgd(1), "owerSGD"),
    (lambda: hvd.Compression.int8, "nt8"),
    (lambda: hvd.Compression.dgc(0.1), "DGC"),
])
def test_compressions_that_cannot_be_reduce_scattered_are_refused(compression, named):
    with pytest.raises(ValueError, match="sharded optimizer is not supported") as caught:
        ShardedOptimizer(_sgd(), compression=compression())
    assert named.lower() in str(caught.value).lower(), str(caught.value)


def test_adasum_is_refused():
    with pytest.raises(ValueError, match="Adasum with a sharded optimizer"):
        ShardedOptimizer(_sgd(), op=hvd.Adasum)


def test_other_ops_are_refused():
    with pytest.raises(ValueError, match="op=Max with a sharded optimizer is not supported"):
        ShardedOptimizer(_sgd(), op=hvd.Max)


def test_sparse_adam_is_refused():
    embedding = torch.nn.Embedding(4, 2, sparse=True)
    with pytest.raises(ValueError, match="SparseAdam"):
        ShardedOptimizer(torch.optim.SparseAdam(embedding.parameters()))


def test_an_optimizer_with_state_is_refused():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already has state"):
        ShardedOptimizer(optimizer)


def test_adagrad_state_from_construction_is_not_refused_and_steps_alike():
    """Adagrad builds its accumulators at construction (step 0): no step is lost, so it is wrapped, and at one
    rank the sharded steps are the plain optimizer's, bit for bit; once stepped it is refused."""
    import hvps

    torch.manual_seed(0)
    ref, model = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.1, initial_accumulator_value=0.25)
    hvps.init()
    try:
        opt = ShardedOptimizer(torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.25))
        for step in range(3):
            x = torch.randn(4, 5)
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad()
                m(x).pow(2).sum().backward()
                o.step()
            for a, b in zip(ref.parameters(), model.parameters()):
                assert torch.equal(a, b), step
    finally:
        hvps.shutdown()
    with pytest.raises(ValueError, match="already has state"):
        ShardedOptimizer(ref_opt)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="wraps a torch.optim.Optimizer"):
        ShardedOptimizer(torch.nn.Linear(3, 2))


def test_bad_arguments():
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        ShardedOptimizer(_sgd(), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ShardedOptimizer(_sgd(), bucket_cap_mb=0)


def test_groups_are_refused():
    with pytest.raises(ValueError, match="groups/num_groups with a sharded optimizer"):
        ShardedOptimizer(_sgd(), groups=2)
    with pytest.raises(ValueError, match="groups/num_groups with a sharded optimizer"):
        ShardedOptimizer(_sgd(), num_groups=2)


def test_distributed_optimizer_with_shard_true_is_the_sharded_optimizer():
    # Horovod's constructor with one more keyword: the same checks run (here: Adasum refused by the sharded kind)
    with pytest.raises(ValueError, match="Adasum with a sharded optimizer"):
        hvd.DistributedOptimizer(_sgd(), op=hvd.Adasum, shard=True)
    with pytest.raises(ValueError, match="sharded optimizer is not supported"):
        hvd.DistributedOptimizer(_sgd(), compression=hvd.Compression.int8, shard=True)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_flat_layout_tiles_every_tensor_exactly_once(size):
    from hvps.core.flat_shards import FlatLayout

    sizes = (5, 0, 7, 1, 12)  # 25 elements: padded at 2, 3 and 4 ranks; an empty tensor between
    layout = FlatLayout(sizes, size)
    assert layout.padded % size == 0 and layout.padded - layout.numel < size
    seen = [[] for _ in sizes]
    for rank in range(size):
        lo, hi = layout.block(rank)
        assert hi - lo == layout.shard_numel
        at = 0
        for index, offset, in_block, n in layout.pieces(rank):
            assert in_block == at and n > 0  # pieces fill the block from its start, in order
            seen[index].extend(range(offset, offset + n))
            at += n
    assert seen == [list(range(n)) for n in sizes]
