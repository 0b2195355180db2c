"""Sharded (ZeRO stage 1-2) vs replicated optimizer (issue 39): optimizer-state bytes per rank and step time.

One mpirun job; both contenders live in it, on two copies of one MLP, and alternate in rounds
(A B A B ...). Each timed step starts after a barrier; the slowest rank's time counts; the result is
the median over all timed steps of each contender. Optimizer-state bytes are counted from the storages
the optimizer's state holds (each storage once), after the first step.

    mpirun -np 2 python benchmarks/sharded_optimizer.py --width 512 --layers 4 --rounds 5 --steps 5
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
import hvps.adapters.torch as hvd  # noqa: E402
from hvps.adapters.torch.sharded_optimizer import ShardedOptimizer  # noqa: E402


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the storages ``optimizer.state`` holds, each counted once."""
    storages = {}
    for entry in optimizer.state.values():
        for value in entry.values():
            if torch.is_tensor(value):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


def mlp(width: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def timed_step(model, optimizer, x) -> float:
    hvd.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    return float(hvd.allreduce(elapsed, op=hvd.Max))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64, help="samples per rank")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="the sharded optimizer's bucket cap")
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    models = {name: mlp(args.width, args.layers) for name in ("replicated", "sharded")}
    optimizers = {
        "replicated": hvd.DistributedOptimizer(torch.optim.Adam(models["replicated"].parameters(), foreach=False),
                                               named_parameters=models["replicated"].named_parameters()),
        "sharded": ShardedOptimizer(torch.optim.Adam(models["sharded"].parameters(), foreach=False),
                                    named_parameters=models["sharded"].named_parameters(),
                                    bucket_cap_mb=args.bucket_cap_mb),
    }
    x = torch.randn(args.batch, args.width)
    times: dict = {name: [] for name in models}
    for name in models:  # warm-up, and the state exists after it
        timed_step(models[name], optimizers[name], x)
    for _ in range(args.rounds):
        for name in models:
            times[name] += [timed_step(models[name], optimizers[name], x) for _ in range(args.steps)]
    numel = sum(p.numel() for p in models["sharded"].parameters())
    result = {
        "ranks": hvd.size(), "parameters": numel,
        "state_bytes_replicated": state_bytes(optimizers["replicated"]),
        "state_bytes_sharded": state_bytes(optimizers["sharded"].shard_optimizer),
        # what the sharded side holds besides: its parameter shards (a copy of 1/N of the parameters), which
        # also carry the averaged gradient shards between synchronize() and the end of step()
        "shard_bytes": sum(b.shard.nbytes for b in optimizers["sharded"]._buckets),
        "gradient_bytes_full": sum(p.nbytes for p in models["replicated"].parameters()),
        "step_ms_median": {name: 1e3 * statistics.median(t) for name, t in times.items()},
    }
    result["state_ratio"] = result["state_bytes_sharded"] / result["state_bytes_replicated"]
    result["sharded_vs_replicated_speed"] = (result["step_ms_median"]["replicated"]
                                             / result["step_ms_median"]["sharded"])
    if hvd.rank() == 0:
        print(json.dumps(result, indent=1))
    hvd.shutdown()


if __name__ == "__main__":
    main()
