"""Inner script for tests/test_multihost.py's capture test (every rank, not collected by pytest): moves a
recognisable byte pattern between hosts by allreduce, broadcast and the sharded store's pull, then prints
``SEALED-DONE rank`` (the outer test sniffs the link meanwhile and looks for the pattern)."""
import sys

import numpy as np
import torch

import hvps.adapters.torch as hvd
from hvps.store import ShardedEmbedding

PATTERN = b"hvps27-CLEAR-txt"  # 16 bytes; the outer test searches the capture for it
block = np.frombuffer(PATTERN * (1 << 16), np.uint8)  # 1 MiB

hvd.init()
rank = hvd.rank()
assert (hvd.allreduce(torch.from_numpy(block.copy()), op=hvd.Max).numpy() == block).all()
assert (hvd.broadcast(torch.from_numpy(block.copy() if rank == 0 else np.zeros_like(block)), 0).numpy() == block).all()
rows = torch.from_numpy(np.frombuffer(PATTERN * 4, np.float32).copy())  # a 16-float row: the pattern 4 times


def _rows(ids, dim):
    return rows.repeat(len(ids), 1)


store = ShardedEmbedding(256, 16, name="sealed", initializer=_rows)
got = store(torch.arange(256))
assert got.detach().numpy().tobytes().count(PATTERN) == 256 * 4
sys.stdout.write(f"SEALED-DONE {rank}\n")
sys.stdout.flush()
hvd.shutdown()
