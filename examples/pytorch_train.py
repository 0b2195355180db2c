"""Data-parallel PyTorch training with hvps: a small MLP on MNIST-like synthetic digits.

What it shows: ``hvd.init()``, one GPU per process pinned by local rank (``--cuda``), each rank
reading its own shard of the data (``DistributedSampler``), ``hvd.DistributedOptimizer`` averaging
the gradients, the model and optimizer state broadcast from rank 0, logs from rank 0 only, and a
versioned checkpoint after every epoch (``hvd.CheckpointManager``) that ``--resume`` continues from,
on any number of ranks.

Launch it from the repository root with any of::

    hvpsrun -np 2 python examples/pytorch_train.py --epochs 2 --steps 8
    hvpsrun -np 3 --max-restarts 3 --checkpoint-dir checkpoints/pytorch_train \
        python examples/pytorch_train.py --epochs 3 --steps 8 --resume
    mpirun -np 2 python examples/pytorch_train.py
    torchrun --standalone --nproc-per-node=2 examples/pytorch_train.py
    python examples/pytorch_train.py            # one process

``--resume`` with nothing to load starts at epoch 0, so a launcher that restarts a failed job can always
pass it, as the second command above does (hvpsrun hands its ``--checkpoint-dir`` to the script as
``HVPS_CHECKPOINT_DIR``), or ``torchrun --max-restarts=2 ... --resume``.
The data is generated, so the script needs nothing but hvps and torch.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvps.adapters.torch as hvd

IMAGE_SIDE, CLASSES = 28, 10


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Read the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3, help="epochs to train in all (a resumed run counts the "
                        "epochs already done)")
    parser.add_argument("--steps", type=int, default=0,
                        help="at most this many steps per epoch on each rank (0: the whole shard)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--samples", type=int, default=2048, help="size of the synthetic training set")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="learning rate of one rank; the job uses lr * number of ranks")
    parser.add_argument("--checkpoint-dir", default=os.environ.get("HVPS_CHECKPOINT_DIR", "checkpoints/pytorch_train"),
                        help="directory of the versioned checkpoints (rank 0 writes it); default: hvpsrun's "
                        "--checkpoint-dir when given, else checkpoints/pytorch_train")
    parser.add_argument("--keep-last", type=int, default=3, help="how many checkpoint versions to keep")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest good checkpoint in --checkpoint-dir (if any)")
    parser.add_argument("--cuda", action="store_true", help="train on the GPU of this rank's local rank")
    parser.add_argument("--seed", type=int, default=42, help="seed of the data and the model's initial weights")
    return parser.parse_args(argv)


def synthetic_digits(samples: int, seed: int) -> TensorDataset:
    """MNIST-shaped data: 1x28x28 images of 10 classes, each a fixed random pattern plus noise.

    Args:
        samples: how many images.
        seed: the generator's seed (the same on every rank, so that every rank sees the same dataset).

    Returns:
        A dataset of (image, label) pairs.
    """
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.rand(CLASSES, 1, IMAGE_SIDE, IMAGE_SIDE, generator=generator)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    noise = torch.randn(samples, 1, IMAGE_SIDE, IMAGE_SIDE, generator=generator)
    return TensorDataset(patterns[labels] + noise, labels)


class SmallMLP(nn.Module):
    """A two-layer perceptron on the flattened 28x28 image (about 51k parameters)."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.hidden = nn.Linear(IMAGE_SIDE * IMAGE_SIDE, hidden)
        self.classifier = nn.Linear(hidden, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores of a batch.

        Args:
            images: a [batch, 1, 28, 28] tensor.

        Returns:
            The [batch, 10] logits.
        """
        return self.classifier(F.relu(self.hidden(torch.flatten(images, 1))))


def choose_device(use_cuda: bool) -> torch.device:
    """This rank's device: its local rank's GPU with ``--cuda``, else the CPU.

    Args:
        use_cuda: whether ``--cuda`` was given.

    Returns:
        The device to train on.

    Raises:
        SystemExit: ``--cuda`` was given but torch sees no GPU.
    """
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("--cuda was given but torch sees no CUDA device; leave --cuda out to train on the CPU")
    torch.cuda.set_device(hvd.local_rank())
    return torch.device("cuda", hvd.local_rank())


def train_one_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, device: torch.device,
                    max_steps: int) -> tuple:
    """One pass over this rank's shard.

    Args:
        model: the model, on ``device``.
        optimizer: the distributed optimizer.
        loader: this rank's batches.
        device: where the batches go.
        max_steps: stop after this many steps (0: no limit).

    Returns:
        (mean loss of the epoch averaged over all ranks, accuracy on the seen samples over all ranks).
    """
    model.train()
    totals = torch.zeros(3, dtype=torch.float64)  # loss * samples, correct predictions, samples
    for step, (images, labels) in enumerate(loader):
        if max_steps and step >= max_steps:
            break
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        totals += torch.tensor([loss.item() * len(labels), (logits.argmax(1) == labels).sum().item(), len(labels)],
                               dtype=torch.float64)
    totals = hvd.allreduce(totals, op=hvd.Sum, name="epoch_totals")  # the same numbers on every rank
    return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train, checkpoint every epoch, and print rank 0's log.

    Args:
        argv: the command line's arguments (default: ``sys.argv[1:]``).
    """
    args = parse_args(argv)
    hvd.init()
    device = choose_device(args.cuda)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (the broadcast below makes sure)

    dataset = synthetic_digits(args.samples, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = SmallMLP().to(device)
    lr = args.lr * hvd.size()  # the global batch grows with the ranks, so does the learning rate
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                         named_parameters=model.named_parameters())

    checkpoints = hvd.CheckpointManager(args.checkpoint_dir, keep_last=args.keep_last)
    start_epoch = 0
    if args.resume:  # collective: rank 0 reads the file, every rank gets the state
        start_epoch = checkpoints.load(model=model, optimizer=optimizer)
        for group in optimizer.param_groups:  # the checkpoint may come from another number of ranks
            group["lr"] = lr
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        where = f"resuming at epoch {start_epoch}" if start_epoch else "starting from scratch"
        print(f"pytorch_train: {hvd.size()} rank(s) on {device.type}, {where}, "
              f"{len(sampler)} samples per rank per epoch, lr {lr:g}", flush=True)
    for epoch in range(start_epoch, args.epochs):
        started = time.perf_counter()
        sampler.set_epoch(epoch)  # a new shuffle, the same on every rank
        loss, accuracy = train_one_epoch(model, optimizer, loader, device, args.steps)
        path = checkpoints.save(epoch, model=model, optimizer=optimizer)  # collective; rank 0 writes
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss:.4f} accuracy {accuracy:.3f} "
                  f"({time.perf_counter() - started:.1f} s) checkpoint {path}", flush=True)
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epoch(s) trained, newest checkpoint in {args.checkpoint_dir}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
