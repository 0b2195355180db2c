"""Fully sharded (ZeRO stage 3) vs replicated training (issue 39): resident bytes per rank and step time.

A stack of transformer encoder blocks (dropout off) with Adam (``foreach=False``), trained on random data.

* ``--framework hvps`` (under ``mpirun``): two copies of the model in one job, hvps's replicated
  ``DistributedOptimizer`` and ``hvd.fully_shard(model, units=[TransformerEncoderLayer])``, alternating in
  rounds (A B A B ...).
* ``--framework fsdp2`` (under ``torchrun``, gloo on CPU): torch's ``fully_shard`` on every block and on
  the root, the side-by-side reference.

Each timed step starts after a barrier; the slowest rank's time counts; the result is the median of
every timed step of a contender. Resident bytes: the storages of the parameters, their gradients and
the optimizer's state (each storage once; a DTensor's local shard), counted after a step, outside forward
and backward. The JSON goes to stdout on rank 0.

    mpirun -np 2 python benchmarks/fully_sharded.py --framework hvps
    torchrun --nproc-per-node 2 benchmarks/fully_sharded.py --framework fsdp2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class BlockStack(torch.nn.Module):
    """Embedding projection, ``depth`` transformer encoder blocks, an output projection."""

    def __init__(self, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
            for _ in range(depth))
        self.head = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def resident_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (DTensors: their local shards), each storage once."""
    storages = {}
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra=()) -> int:
    params = list(model.parameters())
    state = [v for entry in optimizer.state.values() for v in entry.values()]
    return resident_bytes(params + [p.grad for p in params] + state + list(extra))


def step(model, optimizer, x) -> None:
    optimizer.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    optimizer.step()


def run_hvps(args, model_fn, x) -> dict:
    import hvps.adapters.torch as hvd
    from hvps.adapters.torch.fully_sharded import FullyShardedModel

    hvd.init()
    models = {"replicated": model_fn(), "fully_sharded": model_fn()}
    optimizers = {"replicated": hvd.DistributedOptimizer(
        torch.optim.Adam(models["replicated"].parameters(), foreach=False),
        named_parameters=models["replicated"].named_parameters())}
    hvd.fully_shard(models["fully_sharded"], units=[torch.nn.TransformerEncoderLayer], prefetch=not args.no_prefetch)
    optimizers["fully_sharded"] = torch.optim.Adam(models["fully_sharded"].parameters(), foreach=False)

    def timed(name):
        hvd.barrier()
        start = time.perf_counter()
        step(models[name], optimizers[name], x)
        return float(hvd.allreduce(torch.tensor([time.perf_counter() - start]), op=hvd.Max))

    times = {name: [] for name in models}
    for name in models:
        timed(name)
    for _ in range(args.rounds):
        for name in models:
            times[name] += [timed(name) for _ in range(args.steps)]
    full = [p for u in FullyShardedModel.of(models["fully_sharded"]).units for g in u.groups for p in g.full]
    bytes_ = {"replicated": held(models["replicated"], optimizers["replicated"]),
              "fully_sharded": held(models["fully_sharded"], optimizers["fully_sharded"], full)}
    return {"ranks": hvd.size(), "rank": hvd.rank(), "times": times, "bytes": bytes_}


def run_fsdp2(args, model_fn, x) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    model = model_fn()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)

    def timed():
        dist.barrier()
        start = time.perf_counter()
        step(model, optimizer, x)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    timed()
    times = {"fsdp2": [timed() for _ in range(args.rounds * args.steps)]}
    result = {"ranks": dist.get_world_size(), "rank": dist.get_rank(), "times": times,
              "bytes": {"fsdp2": held(model, optimizer)}}
    dist.destroy_process_group()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=["hvps", "fsdp2"], default="hvps")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per contender per round")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--no-prefetch", action="store_true", help="hvps: gather each unit only when it runs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    def model_fn():
        torch.manual_seed(0)
        return BlockStack(args.width, args.depth, args.heads)

    x = torch.randn(args.batch, args.seq, args.width, generator=torch.Generator().manual_seed(1))
    out = (run_hvps if args.framework == "hvps" else run_fsdp2)(args, model_fn, x)
    if out["rank"] == 0:
        reference = held(*_one_process_after_a_step(model_fn, x))
        result = {"framework": args.framework, "ranks": out["ranks"], "width": args.width, "depth": args.depth,
                  "parameters": sum(p.numel() for p in model_fn().parameters()),
                  "step_ms_median": {k: round(1e3 * statistics.median(v), 2) for k, v in out["times"].items()},
                  "resident_bytes_rank0": out["bytes"], "resident_bytes_one_process": reference,
                  "resident_ratio_rank0": {k: round(v / reference, 4) for k, v in out["bytes"].items()}}
        print(json.dumps(result, indent=1))


def _one_process_after_a_step(model_fn, x):
    """A one-process model and Adam after one step: the replicated reference for the byte counts."""
    model = model_fn()
    optimizer = torch.optim.Adam(model.parameters(), foreach=False)
    step(model, optimizer, x)
    return model, optimizer


if __name__ == "__main__":
    main()
