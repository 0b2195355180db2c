"""The dyadic model of the sharded tests: three parallel heads whose loss is linear in their outputs
(``sum(head(x) * t)``), small-integer data and dyadic weights, so that gradients do not depend on the parameters
and are exact in float32 (tests/mpi/mpi_sharded_optimizer.py's trick). Each rank's loss is its part of the global
loss times N, so an Average reduce-scatter yields the one-process run's gradient bit for bit, and element-wise
optimizer kernels (``foreach=False``) do the rest. Two heads are units for ``fully_shard`` (one holding a nested
module); the third head and a scale vector of the model itself form the root unit: 59 parameters, uneven at 2 and
3 ranks. Shared by ``mpi_fully_sharded.py`` and ``tests/inner_jobs/reshard_job.py``.
"""

import torch
from hvps_testutil import dyadic

import hvps.adapters.torch as hvd
from hvps.adapters.torch.fully_sharded import FullyShardedModel

GLOBAL_BATCH = 12
SCALE = 2.0 ** -6


class Pair(torch.nn.Module):
    """A head made of a linear map and a nested one on the same slice (a unit with a submodule)."""

    def __init__(self, inputs, outputs):
        super().__init__()
        self.main = torch.nn.Linear(inputs, outputs)
        self.extra = torch.nn.Linear(inputs, outputs, bias=False)

    def forward(self, x):
        return self.main(x) + self.extra(x)


class Heads(torch.nn.Module):
    """Three heads on slices of the input; ``loss`` is linear in their outputs."""

    def __init__(self):
        super().__init__()
        self.first = Pair(5, 3)  # 18 + 15
        self.second = torch.nn.Linear(4, 2)  # 10
        self.third = torch.nn.Linear(3, 3, bias=False)  # 9 (root)
        self.scale = torch.nn.Parameter(torch.ones(3))  # 3 (root)

    def loss(self, x, targets, factor):
        a, b, c = x[:, :5], x[:, 5:9], x[:, 9:12]
        total = (self(a, b, c) * targets[2]).sum() + (self.first(a) * targets[0]).sum() \
            + (self.second(b) * targets[1]).sum()
        return total * factor

    def forward(self, a, b, c):
        return self.third(c) + self.scale * c


def model():
    """The model every rank and the one-process reference start from: seeded, dyadic weights."""
    torch.manual_seed(11)
    return dyadic(Heads())


def data(step):
    """Step ``step``'s global batch: small-integer inputs and the three heads' targets."""
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randint(-4, 5, (GLOBAL_BATCH, 12), generator=g).float()
    targets = [torch.randint(-4, 5, (GLOBAL_BATCH, o), generator=g).float() for o in (3, 2, 3)]
    return x, targets


def local(x, targets):
    """This rank's rows of the global batch."""
    per = GLOBAL_BATCH // hvd.size()
    rows = slice(hvd.rank() * per, (hvd.rank() + 1) * per)
    return x[rows], [t[rows] for t in targets]


def optimizer(model, kind, lr):
    """SGD with momentum and weight decay, or Adam, in two groups (the root unit's at twice ``lr``); element-wise
    kernels, as the sharded optimizers use."""
    # groups by name: the shards keep their parameters' names
    named = dict(model.named_parameters())
    fast = [named["third.weight"], named["scale"]]
    groups = [{"params": [p for n, p in named.items() if n not in ("third.weight", "scale")]},
              {"params": fast, "lr": lr * 2}]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.5, weight_decay=2.0 ** -5, foreach=False)
    return torch.optim.Adam(groups, lr=lr, foreach=False)


def full(model):
    """A fully sharded ``model``'s gathered parameters (a copy)."""
    with FullyShardedModel.of(model).full_parameters():
        return {k: v.clone() for k, v in model.state_dict().items()}


def assert_equal(full, ref, what):
    """``full`` (parameters by name) equals the reference model's, bit for bit."""
    for name, b in ref.state_dict().items():
        assert torch.equal(full[name], b), f"{what}: {name} differs from the single-process run"


def sharded_steps(model, opt, first, last, size, rank):
    """Steps ``[first, last)`` of a fully sharded model over ``size`` ranks, this one ``rank``."""
    per = GLOBAL_BATCH // size
    rows = slice(rank * per, (rank + 1) * per)
    for step in range(first, last):
        x, targets = data(step)
        opt.zero_grad()
        model.loss(x[rows], [t[rows] for t in targets], SCALE * size).backward()
        opt.step()


def reference_steps(ref, ref_opt, first, last):
    """Steps ``[first, last)`` of the one-process reference on the whole batch."""
    for step in range(first, last):
        x, targets = data(step)
        ref_opt.zero_grad()
        ref.loss(x, targets, SCALE).backward()
        ref_opt.step()


def assert_staged_is_the_reference_slice(staged, model, opt, ref, ref_opt, size, rank):
    """Rank ``rank`` of ``size``'s staged blocks and Adam state are exactly its slices of the one-process run."""
    from hvps.core.flat_shards import FlatLayout

    named = dict(ref.named_parameters())
    position = {id(p): k for k, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for g, group in enumerate(FullyShardedModel.of(model).flat_groups()):
        layout = FlatLayout(tuple(shape.numel() for shape in group.shapes), size)
        flat = torch.cat([named[n].detach().reshape(-1) for n in group.names])
        lo, hi = layout.block(rank)
        expected = torch.zeros(hi - lo)
        expected[: max(0, min(hi, flat.numel()) - lo)] = flat[lo:hi]
        assert torch.equal(staged.blocks[g], expected), (size, rank, group.name)
        for i, offset, _, n in layout.pieces(rank):
            entry = staged.optimizer["state"][position[id(group.shards[i])]]
            reference = ref_opt.state[named[group.names[i]]]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(entry[key], reference[key].reshape(-1)[offset : offset + n]), (size, rank, key)
            assert torch.equal(entry["step"], reference["step"])
