"""Elastic PyTorch training with hvps: the job keeps going when workers join, leave or fail.

What it shows: Horovod's elastic pattern. The training state (model, optimizer, the sampler's
progress, epoch and batch) lives in ``hvd.elastic.TorchState``; ``state.commit()`` every few
batches saves it in memory; ``@hvd.elastic.run`` catches a membership change or a failed rank,
re-initializes hvps with the new ranks, restores the last commit, broadcasts it from rank 0 and
calls the training function again. ``hvd.elastic.ElasticSampler`` splits what is left of the epoch
over the ranks there are now, and a reset callback rescales the learning rate.

Launch it from the repository root under hvpsrun's elastic mode (no MPI needed)::

    hvpsrun -np 2 --min-np 1 --max-np 3 --host-discovery-script examples/discover_hosts.sh \\
        python examples/pytorch_elastic.py --epochs 3

``examples/discover_hosts.sh`` prints ``localhost:2``, or the lines of the file named by
``EXAMPLE_HOSTS_FILE``: edit that file while the job runs (add ``127.0.0.1:1``, remove a line) and
the job grows or shrinks at its next commit. ``hvd.elastic.run`` needs hvpsrun's elastic mode to
change membership; under plain ``hvpsrun -np 2``, ``mpirun`` or ``torchrun`` it runs as a fixed job.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hvps.adapters.torch as hvd

FEATURES, CLASSES = 64, 4


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Read the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train")
    parser.add_argument("--samples", type=int, default=512,
                        help="size of the synthetic training set (split over however many ranks there are)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one rank; the job uses lr * current number of ranks")
    parser.add_argument("--batches-per-commit", type=int, default=2,
                        help="commit the state (in memory) every this many batches; a failure loses at most "
                        "the steps since the last commit")
    parser.add_argument("--seed", type=int, default=7, help="seed of the data, the shuffle and the initial weights")
    return parser.parse_args(argv)


def synthetic_classes(samples: int, seed: int) -> TensorDataset:
    """Points around 4 random centres in 64 dimensions, labelled by their centre.

    Args:
        samples: how many points.
        seed: the generator's seed (the same on every rank).

    Returns:
        A dataset of (features, label) pairs.
    """
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=generator)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    return TensorDataset(centres[labels] + 2.0 * torch.randn(samples, FEATURES, generator=generator), labels)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train under ``hvd.elastic.run`` and print rank 0's log.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    hvd.init()  # once, at the top: a worker that joins later runs the script from here
    torch.manual_seed(args.seed)
    dataset = synthetic_classes(args.samples, args.seed)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
                                         named_parameters=model.named_parameters())
    # no broadcast_parameters here: state.sync() broadcasts everything from rank 0 when train() starts
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:
        """After every membership change: the learning rate follows the number of ranks."""
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: now {hvd.size()} rank(s), lr {args.lr * hvd.size():g}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        """The training loop, called again after each reset with the last committed state."""
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} rank(s) from epoch {state.epoch}", flush=True)
        for state.epoch in range(state.epoch, args.epochs):
            totals = torch.zeros(2, dtype=torch.float64)  # loss * samples, samples (this rank, this call)
            for state.batch, (features, labels) in enumerate(loader, start=state.batch):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(features), labels)
                loss.backward()
                optimizer.step()
                totals += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
                state.sampler.record_batch(state.batch, args.batch_size)
                if (state.batch + 1) % args.batches_per_commit == 0:
                    state.commit()
            totals = hvd.allreduce(totals, op=hvd.Sum, name="epoch_totals")
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: loss {totals[0].item() / max(totals[1].item(), 1):.4f} "
                      f"on {hvd.size()} rank(s)", flush=True)
            state.batch = 0
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epoch(s) trained, ending on {hvd.size()} rank(s)", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
