"""Gradient compression in GRACE's three parts, for every framework adapter.

``Compression.none``, ``.fp16``, ``.bf16``, ``.int8``, ``.topk(density)`` and
``.dgc(density, ...)``, ``.powersgd(rank, ...)`` build a ``GradientCompression``; ``create(name, **kw)``
does the same from a name (``registry.REGISTRY``).
"""

from __future__ import annotations

from .base import Communicator, Compressor, Memory
from .communicators import Allgather, Allreduce
from .compressors import CastCompressor, DensitySchedule, Int8Compressor, NoneCompressor, TopKCompressor
from .lowrank import PowerSGDCompressor
from .memory import DgcMemory, NoMemory, ResidualMemory
from .pipeline import CompressionStats, GradientCompression
from .powersgd import PowerSGDCompression, powersgd
from .powersgd_state import PowerSGDState
from .registry import DGC_WARMUP, REGISTRY, Compression, bf16, create, dgc, fp16, int8, none, topk
from .summable import summable_plan

__all__ = [
    "Compression", "GradientCompression", "CompressionStats", "create", "REGISTRY",
    "Compressor", "Memory", "Communicator", "Allreduce", "Allgather",
    "NoneCompressor", "CastCompressor", "Int8Compressor", "TopKCompressor", "DensitySchedule",
    "NoMemory", "ResidualMemory", "DgcMemory", "DGC_WARMUP", "summable_plan",
    "PowerSGDCompressor", "PowerSGDCompression", "PowerSGDState",
    "none", "fp16", "bf16", "int8", "topk", "dgc", "powersgd",
]
