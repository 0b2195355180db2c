"""Sharded parameter store: embedding tables larger than one rank, with no central server.

Every member of a process set owns one shard of each table (rows by hash of the id, or by
range); lookups and gradients travel by alltoall; each shard sits in host memory or a
memory-mapped file, behind a write-back cache of hot rows.  See README "Sharded parameter
store".
"""

from .cache import CacheStats, RowCache
from .checkpoint import load_stores, save_stores
from .module import ShardedEmbedding, ShardedEmbeddingBag
from .optim import RowAdagrad, RowAdam, RowOptimizer, RowSGD
from .partition import HashPartition, RangePartition, make_partition

__all__ = [
    "ShardedEmbeddingBag", "ShardedEmbedding",
    "RowOptimizer", "RowSGD", "RowAdagrad", "RowAdam",
    "RowCache", "CacheStats",
    "HashPartition", "RangePartition", "make_partition",
    "save_stores", "load_stores",
]
