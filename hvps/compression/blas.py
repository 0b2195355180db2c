"""Run numpy's BLAS on one thread for a while: ``with one_blas_thread(): ...``.

PowerSGD's products are tall and skinny (``(n, m) @ (m, r)``, r <= 32): they are bound by
memory, not arithmetic, and OpenBLAS's threads buy little there while they fight the backward
(and the other ranks on the host) for cores. Measured on ResNet-50's 54 matrices at rank 4
(2 cores): ``P Q^T`` into a preallocated array took 10 ms on 1 thread and 212 ms on 2.

numpy's OpenBLAS is found in the process's mappings, as threadpoolctl finds it; where there is
none (another BLAS, or no ``/proc``), the context does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Iterator, Optional

_PREFIXES = ("scipy_openblas_", "openblas_")
_SUFFIXES = ("64_", "")


def _find() -> Optional[tuple]:
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in _PREFIXES:
            for suffix in _SUFFIXES:
                get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
                put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
                if get is not None and put is not None:
                    get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                    return get, put
    return None


_FUNCS: Optional[tuple] = None
_LOOKED = False


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """numpy's OpenBLAS on one thread inside; its previous thread count restored after."""
    global _FUNCS, _LOOKED
    if not _LOOKED:
        import numpy  # noqa: F401  (its BLAS must be loaded to be found)

        _FUNCS, _LOOKED = _find(), True
    if _FUNCS is None:
        yield
        return
    get, put = _FUNCS
    before = get()
    if before == 1:
        yield
        return
    put(1)
    try:
        yield
    finally:
        put(before)


__all__ = ["one_blas_thread"]
