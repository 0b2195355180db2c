"""The named compressions: ``Compression.none`` / ``.fp16`` / ``.bf16`` / ``.int8`` / ``.topk(...)`` /
``.dgc(...)`` / ``.powersgd(...)``, and ``create(name, **kw)`` through ``REGISTRY`` (name -> constructor)."""

from __future__ import annotations

from typing import Optional, Sequence

from ..core import dtypes
from .compressors import CastCompressor, DensitySchedule, Int8Compressor, NoneCompressor, TopKCompressor
from .memory import DgcMemory, NoMemory, ResidualMemory
from .pipeline import GradientCompression
from .powersgd import powersgd

#: DGC's warm-up (Lin et al.): 25% -> 6.25% -> 1.5625% -> 0.4% over the first epochs, then the target.
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)


def none() -> GradientCompression:
    """No compression: gradients travel as they are."""
    return GradientCompression("none", NoneCompressor())


def fp16() -> GradientCompression:
    """float16 on the wire (2x fewer bytes), prescaled by 1/size when averaging."""
    return GradientCompression("fp16", CastCompressor("float16"))


def bf16() -> GradientCompression:
    """bfloat16 on the wire (2x fewer bytes, float32's range)."""
    return GradientCompression("bf16", CastCompressor(dtypes.bfloat16))


def int8(chunk: int = 256, stochastic: bool = False, error_feedback: bool = False) -> GradientCompression:
    """8-bit quantisation with a float32 scale per ``chunk`` elements (~3.9x fewer bytes).

    Args:
        chunk: elements that share one float32 scale.
        stochastic: round stochastically instead of to the nearest level.
        error_feedback: keep each rank's quantisation error and add it to the next step's gradient.

    Returns:
        The compression, for ``DistributedOptimizer(compression=...)``.
    """
    memory = ResidualMemory() if error_feedback else NoMemory()
    return GradientCompression("int8", Int8Compressor(chunk, stochastic), memory)


def topk(density: float = 0.01, error_feedback: bool = True, selection: str = "sampled") -> GradientCompression:
    """Send the ``density`` fraction of largest gradients; error feedback keeps the rest for later.

    Args:
        density: fraction of each gradient's entries sent, in (0, 1].
        error_feedback: keep the entries not sent and add them to the next step's gradient.
        selection: ``"sampled"`` (DGC's threshold estimated on a sample) or ``"exact"`` (a full top-k).

    Returns:
        The compression, for ``DistributedOptimizer(compression=...)``.
    """
    memory = ResidualMemory() if error_feedback else NoMemory()
    return GradientCompression(f"topk({density})", TopKCompressor(density, selection), memory)


def dgc(density: float = 0.001, momentum: float = 0.9, clip_norm: Optional[float] = None,
        warmup: Sequence[float] = DGC_WARMUP, selection: str = "sampled") -> GradientCompression:
    """Deep Gradient Compression: top-k with momentum correction, clipping, masking and warm-up.

    Use it with a plain SGD optimizer (no momentum): DGC applies momentum locally.
    Call ``set_epoch(epoch)`` on the optimizer (or this object) each epoch for the warm-up.

    Args:
        density: the fraction of entries sent once the warm-up is over, in (0, 1].
        momentum: the momentum DGC applies locally, before selection.
        clip_norm: clip each rank's gradient to this norm before accumulation; None: no clipping.
        warmup: a list of densities, one per epoch from epoch 0 (the default sends 25%, 6.25%,
            1.5625% and 0.4% in the first four epochs); later epochs use ``density``. An empty
            list starts at ``density``.
        selection: ``"sampled"`` (threshold estimated on a sample) or ``"exact"``.

    Returns:
        The compression, for ``DistributedOptimizer(compression=...)``.

    Raises:
        ValueError: a density outside (0, 1].
    """
    schedule = DensitySchedule(density, list(warmup))
    return GradientCompression(f"dgc({density})", TopKCompressor(schedule.at(0), selection),
                               DgcMemory(momentum, clip_norm), schedule=schedule)


class _Namespace:
    """``Compression.none`` / ``.fp16`` / ``.bf16`` / ``.int8`` are ready objects; ``topk``, ``dgc``,
    ``powersgd`` build one."""

    @property
    def none(self) -> GradientCompression:
        return none()

    @property
    def fp16(self) -> GradientCompression:
        return fp16()

    @property
    def bf16(self) -> GradientCompression:
        return bf16()

    @property
    def int8(self) -> GradientCompression:
        return int8()

    topk = staticmethod(topk)
    dgc = staticmethod(dgc)
    powersgd = staticmethod(powersgd)
    # int8 with options (chunk, stochastic, error_feedback); in this class body the name int8 is the property
    quantize = staticmethod(globals()["int8"])


Compression = _Namespace()

#: name -> constructor, for command lines and config files.
REGISTRY = {"none": none, "fp16": fp16, "bf16": bf16, "int8": int8, "topk": topk, "dgc": dgc,
            "powersgd": powersgd}


def create(name: str, **kwargs) -> GradientCompression:
    """Build the compression called ``name`` (see ``REGISTRY``) with keyword hyper-parameters."""
    try:
        factory = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; choose one of {', '.join(REGISTRY)}") from None
    return factory(**kwargs)
