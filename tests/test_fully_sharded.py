"""``fully_shard``'s refusals at construction (issue 39, stage 3): checked before any collective, so no
hvps.init here.

The multi-rank behaviour (bit-exactness, resident bytes, prefetching, mismatched parameters) is tested in
tests/mpi/mpi_fully_sharded.py, inside the shared jobs of tests/test_multirank.py.
"""

import pytest
import torch

import hvps.adapters.torch as hvd
from hvps.adapters.torch.fully_sharded import FullyShardedModel, fully_shard


def _model():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("compression, named", [
    (lambda: hvd.Compression.topk(0.1), "top"),
    (lambda: hvd.Compression.powersgd(1), "owerSGD"),
    (lambda: hvd.Compression.int8, "nt8"),
    (lambda: hvd.Compression.dgc(0.1), "DGC"),
])
def test_compressions_that_cannot_be_reduce_scattered_are_refused(compression, named):
    with pytest.raises(ValueError, match="with fully_shard is not supported") as caught:
        fully_shard(_model(), compression=compression())
    assert named.lower() in str(caught.value).lower(), str(caught.value)


def test_adasum_is_refused():
    with pytest.raises(ValueError, match="op=Adasum with fully_shard is not supported"):
        fully_shard(_model(), op=hvd.Adasum)


def test_other_ops_are_refused():
    with pytest.raises(ValueError, match="op=Max with fully_shard is not supported"):
        fully_shard(_model(), op=hvd.Max)


def test_sparse_gradients_are_refused():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"sparse gradients with fully_shard are not supported: 0 \(Embedding\)"):
        fully_shard(model)


def test_weights_tied_across_units_are_refused():
    encoder, decoder = torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(4, 3, bias=False)
    decoder.weight = torch.nn.Parameter(torch.zeros(3, 4))
    encoder.weight = decoder.weight
    both = torch.nn.Sequential(encoder, decoder)
    with pytest.raises(ValueError, match="tied weights in units '0' and '1'"):
        fully_shard(both, units=[encoder, decoder])


def test_units_must_be_called_submodules():
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    with pytest.raises(ValueError, match="ModuleList cannot be a unit"):
        fully_shard(model, units=[model[0]])
    with pytest.raises(ValueError, match="not a submodule of the model"):
        fully_shard(_model(), units=[torch.nn.Linear(2, 2)])


def test_the_controller_of_a_plain_model_is_refused():
    with pytest.raises(ValueError, match="not fully sharded"):
        FullyShardedModel.of(_model())
