"""A recommender-style model whose embedding table is sharded over the ranks with ``hvps.store``.

What it shows: ``hvps.store.ShardedEmbeddingBag``, an embedding table split row-wise over every rank
(no rank holds all of it, no parameter server): a forward pulls the rows of the batch's item ids from
their owners by alltoall and pools them; the backward pushes the gradient rows back and the owners
step a row-wise Adagrad in place. The small dense tower beside it trains with
``hvd.DistributedOptimizer`` as usual. ``emb.prefetch(next_ids)``, after this step's forward, sends the next
batch's lookup during this step's backward. After each epoch ``save_stores`` writes every rank's shard plus the dense checkpoint;
``--resume`` reloads them with ``load_stores`` (on any number of ranks: the table is re-sharded).

Launch it from the repository root with::

    mpirun -np 2 python examples/sharded_store.py --epochs 2 --steps 10
    hvpsrun -np 2 python examples/sharded_store.py --epochs 3 --steps 10 --resume
    python examples/sharded_store.py             # one process: one shard holds every row

The task: each sample is a bag of item ids, clicked (1) when the items' hidden scores add up to more
than zero; the model learns one embedding per item and a linear read-out.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import hvps.adapters.torch as hvd
from hvps.store import ShardedEmbeddingBag, load_stores, save_stores


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Read the command line.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The parsed flags.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--items", type=int, default=20_000, help="rows of the embedding table (one per item)")
    parser.add_argument("--dim", type=int, default=16, help="embedding width")
    parser.add_argument("--bag-size", type=int, default=8, help="item ids per sample")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per step on each rank")
    parser.add_argument("--epochs", type=int, default=3, help="epochs in all (a resumed run counts those done)")
    parser.add_argument("--steps", type=int, default=50, help="steps per epoch on each rank")
    parser.add_argument("--lr", type=float, default=0.3, help="learning rate of the table's row-wise Adagrad "
                        "and of the dense tower's SGD")
    parser.add_argument("--cache-rows", type=int, default=4096,
                        help="rows of the write-back cache in front of this rank's shard (0: none)")
    parser.add_argument("--checkpoint-dir", default="checkpoints/sharded_store",
                        help="checkpoint directory, shared by all ranks (each writes its own shard)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in --checkpoint-dir (if any)")
    parser.add_argument("--cuda", action="store_true",
                        help="dense tower and row cache on the GPU of this rank's local rank")
    parser.add_argument("--seed", type=int, default=3, help="seed of the data")
    return parser.parse_args(argv)


class ClickData:
    """Synthetic clicks: item ids skewed towards popular items, labelled by hidden per-item scores.

    Args:
        items: number of distinct items.
        bag_size: item ids per sample.
        seed: seed of the hidden scores (the same on every rank).
    """

    def __init__(self, items: int, bag_size: int, seed: int) -> None:
        self.items, self.bag_size, self.seed = items, bag_size, seed
        self.scores = torch.randn(items, generator=torch.Generator().manual_seed(seed))

    def batch(self, epoch: int, step: int, rank: int, batch_size: int) -> tuple:
        """One rank's batch of one step (different on every rank).

        Args:
            epoch: the epoch.
            step: the step within the epoch.
            rank: the rank whose batch this is.
            batch_size: samples in the batch.

        Returns:
            (ids [batch_size, bag_size] int64, labels [batch_size] float32).
        """
        generator = torch.Generator().manual_seed(hash((self.seed, epoch, step, rank)) % 2 ** 63)
        skewed = torch.rand(batch_size, self.bag_size, generator=generator) ** 3  # popular items come up often
        ids = (skewed * self.items).long().clamp_(max=self.items - 1)
        labels = (self.scores[ids].sum(1) > 0).float()
        return ids, labels


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Train the sharded table and the dense tower, checkpoint each epoch, and print rank 0's log.

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

    # collective: every rank builds the table with the same arguments and owns about items / size rows
    embeddings = ShardedEmbeddingBag(args.items, args.dim, mode="sum", name="items", optimizer="adagrad",
                                     lr=args.lr, cache_rows=args.cache_rows, device=device.type)
    tower = nn.Linear(args.dim, 1).to(device)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(tower.parameters(), lr=args.lr),
                                         named_parameters=tower.named_parameters())
    checkpoints = hvd.CheckpointManager(args.checkpoint_dir, keep_last=2)
    start_epoch = 0
    if args.resume:  # the newest version whose every shard checks out, re-sharded for this many ranks
        start_epoch = load_stores(checkpoints, [embeddings], model=tower, optimizer=optimizer)
    hvd.broadcast_parameters(tower.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = ClickData(args.items, args.bag_size, args.seed)
    if hvd.rank() == 0:
        where = f"resuming at epoch {start_epoch}" if start_epoch else "starting from scratch"
        print(f"sharded_store: {hvd.size()} rank(s), table of {args.items} x {args.dim} "
              f"({args.items // hvd.size()} rows or so per rank), {where}", flush=True)
    for epoch in range(start_epoch, args.epochs):
        totals = torch.zeros(3, dtype=torch.float64)  # loss * samples, correct predictions, samples
        ids, labels = data.batch(epoch, 0, hvd.rank(), args.batch_size)
        for step in range(args.steps):
            optimizer.zero_grad()
            pooled = embeddings(ids)
            if step + 1 < args.steps:  # the next batch's lookup travels during this backward and step
                next_ids, next_labels = data.batch(epoch, step + 1, hvd.rank(), args.batch_size)
                embeddings.prefetch(next_ids)
            logits = tower(pooled.to(device)).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(device))
            loss.backward()  # the table's rows are updated by their owners here
            optimizer.step()
            totals += torch.tensor([loss.item() * len(labels), ((logits > 0).float().cpu() == labels).sum().item(),
                                    len(labels)], dtype=torch.float64)
            if step + 1 < args.steps:
                ids, labels = next_ids, next_labels
        totals = hvd.allreduce(totals, op=hvd.Sum, name="epoch_totals")
        save_stores(checkpoints, epoch, [embeddings], model=tower, optimizer=optimizer)  # collective
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {totals[0].item() / totals[2].item():.4f} "
                  f"accuracy {totals[1].item() / totals[2].item():.3f}", flush=True)
    stats = embeddings.stats()
    if hvd.rank() == 0:
        print(f"rank 0's shard: {stats['tier_bytes']} bytes in host memory, cache hit rate "
              f"{stats.get('hit_rate', 0.0):.2f}, {stats['bytes_sent']} bytes sent", flush=True)
        print(f"done: {args.epochs} epoch(s) trained, newest checkpoint in {args.checkpoint_dir}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
