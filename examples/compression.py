"""Gradient compression with hvps: fp16, top-k with error feedback, or PowerSGD, picked by a flag.

What it shows: ``hvd.DistributedOptimizer(..., compression=...)`` with one of hvps's compressions:

- ``fp16``: gradients travel as float16 (half the bytes), summed in float16;
- ``topk``: each rank sends only the ``--density`` largest gradient entries; what it leaves out is
  kept (error feedback) and added to the next step's gradient, so nothing is lost, only delayed;
- ``powersgd``: each gradient matrix travels as two rank-``--powersgd-rank`` factors (Vogels et
  al. 2019), with error feedback; the first ``--powersgd-start`` steps travel uncompressed.

Rank 0 logs the loss and the compression's own counters (how many times fewer bytes a plain
allreduce would have sent). Launch it from the repository root with::

    hvpsrun -np 2 python examples/compression.py --compression topk
    hvpsrun -np 2 python examples/compression.py --compression powersgd
    hvpsrun -np 2 python examples/compression.py --compression fp16
    python examples/compression.py --compression none      # one process, for comparison
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import hvps.adapters.torch as hvd

FEATURES, CLASSES = 256, 8
CHOICES = ("none", "fp16", "topk", "powersgd")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Read the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--compression", choices=CHOICES, default="topk", help="how gradients travel")
    parser.add_argument("--density", type=float, default=0.01,
                        help="topk: the fraction of each gradient's entries a rank sends per step")
    parser.add_argument("--powersgd-rank", type=int, default=2, help="powersgd: rank of the low-rank factors")
    parser.add_argument("--powersgd-start", type=int, default=2,
                        help="powersgd: steps that travel uncompressed before the factors are used")
    parser.add_argument("--steps", type=int, default=30, help="training steps (on every rank)")
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 logs every this many steps")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one rank; the job uses lr * number of ranks")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of this rank's local rank")
    parser.add_argument("--seed", type=int, default=11, help="seed of the data and the initial weights")
    return parser.parse_args(argv)


def make_compression(args: argparse.Namespace) -> object:
    """The compression the flags ask for.

    Args:
        args: the parsed flags.

    Returns:
        An ``hvd.Compression`` object for ``hvd.DistributedOptimizer``.
    """
    if args.compression == "fp16":
        return hvd.Compression.fp16
    if args.compression == "topk":
        return hvd.Compression.topk(args.density, error_feedback=True)
    if args.compression == "powersgd":
        return hvd.Compression.powersgd(rank=args.powersgd_rank, start_iter=args.powersgd_start)
    return hvd.Compression.none


def batch_of(step: int, rank: int, batch_size: int, teacher: nn.Module) -> tuple:
    """One rank's batch: random inputs labelled by a fixed random teacher network.

    Args:
        step: the step (each step a new batch).
        rank: the rank (each rank its own batch).
        batch_size: samples in the batch.
        teacher: the network whose predictions are the labels.

    Returns:
        (inputs [batch_size, 256], labels [batch_size]).
    """
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    inputs = torch.randn(batch_size, FEATURES, generator=generator)
    with torch.no_grad():
        labels = teacher(inputs).argmax(1)
    return inputs, labels


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train with the chosen compression and print rank 0's log.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).

    Raises:
        SystemExit: ``--cuda`` was given but torch sees no CUDA device.
    """
    args = parse_args(argv)
    hvd.init()
    if args.cuda and not torch.cuda.is_available():
        raise SystemExit("--cuda was given but torch sees no CUDA device; leave --cuda out to train on the CPU")
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if args.cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    teacher = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, CLASSES))
    model = nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES)).to(device)
    compression = make_compression(args)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"compression: {hvd.size()} rank(s), --compression {args.compression}, {args.steps} steps", flush=True)
    running = []
    for step in range(args.steps):
        inputs, labels = batch_of(step, hvd.rank(), args.batch_size, teacher)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs.to(device)), labels.to(device))
        loss.backward()
        optimizer.step()
        running.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean_loss = hvd.allreduce(torch.tensor(sum(running) / len(running)), op=hvd.Average, name="logged_loss")
            running = []
            if hvd.rank() == 0:
                print(f"step {step + 1}: loss {mean_loss.item():.4f}", flush=True)
    stats = getattr(compression, "stats", None)  # the counters of this rank's exchanges
    if hvd.rank() == 0:
        if stats is not None and stats.exchanges:
            print(f"{args.compression}: {stats.exchanges} exchanges, {stats.bytes_sent} bytes sent where a plain "
                  f"allreduce sends {stats.dense_bytes}: {stats.ratio:.1f}x fewer", flush=True)
        print(f"done: {args.steps} steps trained with --compression {args.compression}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
