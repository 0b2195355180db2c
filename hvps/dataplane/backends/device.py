"""Ordering collectives on CUDA tensors against the streams that produce and consume them.

As Horovod's ``ready_event``: the submitting thread records an event on its
current stream (``arrays.ready_event``); the engine enqueues the collective on
a stream of its own that first waits for that event, then records a done event
that ``Handle.wait`` makes the waiter's stream wait for. Neither side blocks
the host, and there is no device-wide synchronisation on the hot path.
"""

from __future__ import annotations

import contextlib

from ...core import arrays

_streams: dict = {}


def _device_inputs(entries: list):
    for entry in entries:
        if entry is None:
            continue
        for array in entry.inputs:
            if arrays.device_of(array) == "cuda":
                return array.device
    return None


@contextlib.contextmanager
def cuda_order(entries: list, host_sync: bool):
    """Run the body on the engine's CUDA stream, after every entry's ready event.

    ``host_sync`` waits on the host too before the body: needed by data planes
    that read device memory from the host thread (CUDA-aware MPI), not by NCCL.
    Host-only responses run unchanged.
    """
    device = _device_inputs(entries)
    if device is None:
        yield
        return
    import torch

    stream = _streams.get(device)
    if stream is None:
        stream = _streams[device] = torch.cuda.Stream(device=device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for entry in entries:
            if entry is not None and entry.ready_event is not None:
                stream.wait_event(entry.ready_event)
        if host_sync:
            stream.synchronize()
        yield
        done = torch.cuda.Event()
        done.record(stream)
        if host_sync:
            done.synchronize()
    for entry in entries:
        if entry is not None:
            entry.handle.event = done
