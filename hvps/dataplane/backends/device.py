"""Ordering collectives on CUDA tensors against the streams that produce and consume them.

As Horovod's ``ready_event``: the submitting thread records an event on its
current stream (``arrays.ready_event``); the engine enqueues the collective on
a stream of its own that first waits for that event, then records a done event
that ``Handle.wait`` makes the waiter's stream wait for. Neither side blocks
the host, and there is no device-wide synchronisation on the hot path.

Every call names the tensors' device: the engine thread, the waiting thread and
the metrics thread never rely on their "current" CUDA device, which is 0 on a
thread that never set one (issue 43, findings 1 and 2). As ProcessGroupNCCL
does with its NCCL stream, every CUDA input and output is marked in use by the
engine's stream (``record_stream``) while the collective runs there, and each
result is marked in use by the consumer's stream when it is waited for, so the
caching allocator never hands out a block that another stream still reads
(finding 10).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

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


def _cuda_tensors(result: Any) -> Iterator[Any]:
    """The CUDA tensors in a collective's result (a tensor, or lists and tuples of them and of arrays)."""
    if isinstance(result, (list, tuple)):
        for item in result:
            yield from _cuda_tensors(item)
    elif result is not None and not arrays.is_numpy(result) and getattr(result, "device", None) is not None \
            and result.device.type == "cuda":
        yield result


class Done:
    """A collective's done event and its device: what ``Handle.wait`` orders the consumer after."""

    __slots__ = ("event", "device")

    def __init__(self, event: Any, device: Any) -> None:
        self.event = event
        self.device = device

    def wait(self, result: Any = None) -> None:
        """Make the calling thread's current stream *on the tensors' device* wait for the collective, and
        mark ``result``'s tensors in use by that stream (the host does not wait)."""
        consumer = sys.modules["torch"].cuda.current_stream(self.device)
        consumer.wait_event(self.event)
        for tensor in _cuda_tensors(result):
            tensor.record_stream(consumer)

    def query(self) -> bool:
        """Whether the GPU has finished the collective (never blocks)."""
        return self.event.query()

    def synchronize(self) -> None:
        """Block the host until the GPU has finished the collective."""
        self.event.synchronize()


def engine_stream(device) -> Any:
    """The engine's stream on ``device`` (made once per device)."""
    stream = _streams.get(device)
    if stream is None:
        import torch

        # the highest priority, as Horovod's: communication is not queued behind the backward's kernels
        stream = _streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return stream


@contextlib.contextmanager
def cuda_order(entries: list, host_sync: bool):
    """Run the body on the engine's CUDA stream, after every entry's ready event.

    ``host_sync``: the data plane reads device memory from the host thread (CUDA-aware
    MPI): the host waits for the stream before each such read (``settle``, called by the
    backend right before MPI touches the buffers, after the fusion packing, prescale or
    copy this body queued) and for the done event at the end. NCCL needs neither.
    Host-only responses run unchanged.
    """
    device = _device_inputs(entries)
    if device is None:
        yield
        return
    import torch

    stream = engine_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for entry in entries:
            if entry is None:
                continue
            if entry.ready_event is not None:
                stream.wait_event(entry.ready_event)
            for tensor in _cuda_tensors(entry.inputs + entry.outputs):
                tensor.record_stream(stream)  # not reused before the engine's stream is done with it
        yield
        done = torch.cuda.Event()
        done.record(stream)
        if host_sync:
            done.synchronize()
    finished = Done(done, device)
    for entry in entries:
        if entry is not None:
            entry.handle.event = finished


def settle(*buffers) -> None:
    """Block the host until the current stream of each CUDA buffer's device has run what is queued on
    it: called by a data plane (CUDA-aware MPI) right before it reads or writes device memory from the
    host thread, so that the work the executor queued just before (packing, prescale, a copy) is done."""
    seen = set()
    for buffer in buffers:
        if arrays.is_numpy(buffer) or getattr(buffer, "device", None) is None or buffer.device.type != "cuda":
            continue
        if buffer.device not in seen:
            seen.add(buffer.device)
            sys.modules["torch"].cuda.current_stream(buffer.device).synchronize()
