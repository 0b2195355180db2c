"""The GPU path's bookkeeping on a CPU (issue 43): which device and stream each thread names, when the
host waits, which streams hold which blocks, where a joined rank's zeros and a broadcast object land.

No GPU here, so the CUDA runtime is replaced by a recorder (``FakeCuda``): streams, events, the current
stream per device, and tensors that report a CUDA device. Only CUDA runtime calls are faked; hvps's own
code (handles, the stream ordering, the executors, the MPI backend's buffer specs, devices, metrics,
the torch adapter's object broadcast) runs as it is. ``tests/test_gpu.py`` runs the same paths on a GPU.
"""

import contextlib
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvps.control.negotiation import ALLREDUCE, BROADCAST, Coordinator, Request, Response  # noqa: E402
from hvps.core import devices  # noqa: E402
from hvps.core.errors import HvpsError  # noqa: E402
from hvps.core.handle import Handle  # noqa: E402
from hvps.dataplane import executors  # noqa: E402
from hvps.dataplane.backends import device as device_order  # noqa: E402
from hvps.dataplane.executors import Context, Entry  # noqa: E402

pytestmark = pytest.mark.unit


class FakeStream:
    def __init__(self, log, device, kind):
        self.log, self.device, self.kind = log, device, kind

    def wait_event(self, event):
        self.log.append(("wait_event", self.kind, str(self.device), event.label))

    def synchronize(self):
        self.log.append(("stream.synchronize", self.kind, str(self.device)))

    def __repr__(self):
        return f"<{self.kind} stream {self.device}>"


class FakeEvent:
    count = 0

    def __init__(self, log):
        FakeEvent.count += 1
        self.log, self.label, self.finished = log, f"event{FakeEvent.count}", False

    def record(self, stream=None):
        self.log.append(("record", self.label, stream.kind if stream else None, str(getattr(stream, "device", None))))

    def wait(self, stream=None):  # torch.cuda.Event.wait: the *current* device's stream when none is given
        self.log.append(("event.wait", self.label, None if stream is None else stream.kind))

    def query(self):
        return self.finished

    def synchronize(self):
        self.log.append(("event.synchronize", self.label))


class FakeCudaTensor:
    """A tensor that reports a CUDA device: what the engine sees of a CUDA tensor, minus the memory."""

    def __init__(self, log, index, n=4, label="t"):
        self.log, self.device, self.label = log, torch.device("cuda", index), label
        self.dtype, self.shape, self.ndim = torch.float32, (n,), 1

    def numel(self):
        return self.shape[0]

    def reshape(self, *shape):
        return self

    def data_ptr(self):
        return id(self)

    def record_stream(self, stream):
        self.log.append(("record_stream", self.label, stream.kind, str(stream.device)))

    def __setitem__(self, key, value):
        self.log.append(("copy", self.label, getattr(value, "label", None)))


class FakeCuda:
    """torch.cuda's runtime calls, recorded. ``current_device`` is 0, as on a thread that never set one."""

    def __init__(self, monkeypatch):
        self.log = []
        self._current = {}
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: 4)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "Stream", self.stream)
        monkeypatch.setattr(cuda, "Event", lambda *a, **k: FakeEvent(self.log))
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(device_order, "_streams", {})

    def stream(self, device=None, priority=0):
        self.log.append(("Stream", str(device), priority))
        return FakeStream(self.log, device, "engine")

    def current_stream(self, device=None):
        device = torch.device("cuda", 0) if device is None else device  # torch: the current device, 0 here
        self.log.append(("current_stream", str(device)))
        if device not in self._current:
            self._current[device] = FakeStream(self.log, device, "consumer")
        return self._current[device]

    def tensor(self, index, label="t", n=4):
        return FakeCudaTensor(self.log, index, n, label)

    def event(self):
        return FakeEvent(self.log)


@pytest.fixture
def cuda(monkeypatch):
    devices.reset()
    yield FakeCuda(monkeypatch)
    devices.reset()


def _entry(name, inputs, outputs, ready=None, kind=ALLREDUCE):
    request = Request(name, kind, "float32", tuple(tuple(t.shape) for t in inputs), "sum", device="cuda",
                      root=0 if kind == BROADCAST else -1)
    return Entry(request, list(inputs), list(outputs), handle=Handle(name), ready_event=ready)


# -- finding 1: the consumer waits on the tensor's device, whatever its thread's current device ----------
def test_wait_orders_the_consumer_stream_of_the_tensors_device_not_cuda0(cuda):
    x = cuda.tensor(1, "x")
    ready = cuda.event()
    entry = _entry("g", [x], [x], ready)
    with device_order.cuda_order([entry], host_sync=False):
        cuda.log.append(("body",))
    assert ("wait_event", "engine", "cuda:1", ready.label) in cuda.log  # the engine waits for the producer
    assert ("Stream", "cuda:1", -1) in cuda.log  # the engine's stream has the highest priority (finding 12)
    entry.handle.set_result(x)
    del cuda.log[:]
    assert entry.handle.wait() is x
    # the waiter's current stream on cuda:1 waits for the done event; cuda:0 is never touched
    assert ("current_stream", "cuda:1") in cuda.log
    assert not any(item[0] == "current_stream" and item[1] == "cuda:0" for item in cuda.log), cuda.log
    assert any(item[:3] == ("wait_event", "consumer", "cuda:1") for item in cuda.log), cuda.log
    assert not any(item[0] == "event.wait" for item in cuda.log), cuda.log


# -- finding 10: record_stream on the engine's stream while it runs, on the consumer's when waited for ---
def test_inputs_and_outputs_are_held_by_the_engine_stream_and_results_by_the_consumer(cuda):
    src, out = cuda.tensor(2, "src"), cuda.tensor(2, "out")
    entry = _entry("ag", [src], [], cuda.event())
    with device_order.cuda_order([entry], host_sync=False):
        pass
    assert ("record_stream", "src", "engine", "cuda:2") in cuda.log
    entry.handle.set_result([out, np.arange(2)])  # e.g. alltoall: (output, received splits)
    entry.handle.wait()
    assert ("record_stream", "out", "consumer", "cuda:2") in cuda.log


# -- finding 14: poll() is true once the GPU is done, not once the engine enqueued the work -------------
def test_poll_is_false_until_the_gpu_has_finished(cuda):
    x = cuda.tensor(0, "x")
    entry = _entry("p", [x], [x], cuda.event())
    with device_order.cuda_order([entry], host_sync=False):
        pass
    entry.handle.set_result(x)
    derived = entry.handle.then(lambda r: r)
    assert entry.handle.finished and not entry.handle.poll() and not derived.poll()
    entry.handle.event.event.finished = True
    assert entry.handle.poll() and derived.poll()


# -- finding 3: CUDA-aware MPI reads device memory only after the engine stream ran the executor's work --
class RecordingComm:
    """An MPI communicator of one rank that records its calls (MPI cannot read fake device memory)."""

    def __init__(self, log):
        self.log = log

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def Bcast(self, buf, root=0):
        self.log.append(("MPI.Bcast", buf[0].label))

    def Allreduce(self, send, recv, op=None):
        self.log.append(("MPI.Allreduce", recv[0].label))

    def Free(self):
        pass


def test_cuda_aware_mpi_waits_for_the_queued_copy_before_mpi_reads_the_buffer(cuda):
    from hvps.dataplane.backends.mpi import MPIBackend

    settings = types.SimpleNamespace(algorithm="native", ring_chunk_bytes=1 << 20, stall_fail_seconds=60.0)
    backend = MPIBackend(RecordingComm(cuda.log), settings, owned=True)
    backend.cuda_aware = True  # as MPIX_Query_cuda_support answers on a CUDA-aware Open MPI
    src, out = cuda.tensor(1, "src"), cuda.tensor(1, "out")
    entry = _entry("b", [src], [out], cuda.event(), kind=BROADCAST)
    response = Response(BROADCAST, ["b"], requests=[entry.request])
    with backend.ordered([entry]):
        executors.run_broadcast(Context(backend, 0, 1), response, [entry])
    steps = [item[:2] for item in cuda.log if item[0] in ("copy", "stream.synchronize", "MPI.Bcast")]
    # broadcast's copy is queued on the engine stream; the host waits for it, then MPI reads
    assert steps == [("copy", "out"), ("stream.synchronize", "consumer"), ("MPI.Bcast", "out")], cuda.log


# -- finding 2: a joined rank's zeros lie on its own GPU, and join(device) is honoured -----------------------
def test_joined_rank_makes_zeros_on_its_gpu_not_on_cuda0(cuda, monkeypatch):
    made = []
    real_zeros = torch.zeros

    def zeros(shape, dtype=None, device=None):  # a CUDA allocation: recorded, made on the host
        made.append(str(device))
        return real_zeros(shape, dtype=dtype)

    monkeypatch.setattr(torch, "zeros", zeros)
    request = Request("j", ALLREDUCE, "float32", ((3,),), "sum", device="cuda")
    devices.reset(local_rank=1)  # no CUDA tensor submitted yet: the local rank's GPU
    executors._zeros_for(request)
    devices.check("w", [cuda.tensor(2)])  # this rank's tensors are on cuda:2
    executors._zeros_for(request)
    devices.set_join_device(3)  # join(device=3)
    executors._zeros_for(request)
    devices.set_join_device(-1)  # Horovod's default: back to the rank's device
    executors._zeros_for(request)
    assert made == ["cuda:1", "cuda:2", "cuda:3", "cuda:2"]


# -- bad input: one device per collective and per rank, refused before anything is enqueued --------------
def test_mixed_devices_in_one_collective_are_refused_naming_tensor_and_devices(cuda):
    with pytest.raises(HvpsError, match=r"'grads'.*\['cuda:0', 'cuda:1'\]"):
        devices.check("grads", [cuda.tensor(0), cuda.tensor(1)])
    with pytest.raises(HvpsError, match=r"'mix'.*\['cpu', 'cuda:0'\]"):
        devices.check("mix", [torch.zeros(2), cuda.tensor(0)])
    assert devices.chosen() is None  # nothing chosen by a refused call


def test_a_tensor_on_another_gpu_than_the_ranks_is_refused(cuda):
    assert devices.check("a", [cuda.tensor(1)]) == 1
    assert devices.check("b", [cuda.tensor(1)]) == 1
    with pytest.raises(HvpsError, match=r"'c' is a tensor on cuda:0.*run on cuda:1"):
        devices.check("c", [cuda.tensor(0)])


def test_cpu_and_cuda_under_one_name_across_ranks_is_a_mismatch_naming_both():
    c = Coordinator(size=2, fusion_threshold=0, stall_seconds=10)
    c.submit(0, [Request("w", ALLREDUCE, "float32", ((4,),), "sum", device="cpu")], 0)
    c.submit(1, [Request("w", ALLREDUCE, "float32", ((4,),), "sum", device="cuda")], 0)
    (response,) = c.poll(0)
    assert "'w'" in response.error and "on cpu" in response.error and "on cuda" in response.error


# -- finding 9: the metrics thread reports this rank's GPU, not its own current device (0) ---------------
def test_gpu_metrics_follow_the_ranks_device_not_the_metrics_threads(cuda):
    from hvps.metrics.system import GpuCollector

    collector = GpuCollector("1", "host", local_rank=1)
    assert collector._cuda_index() == 1  # torch says current_device() == 0 on this thread
    devices.check("w", [cuda.tensor(3)])
    assert collector._cuda_index() == 3


# -- finding 8: objects from other ranks land on this rank's GPU (or the host), never on the sender's ----
class FakeStorage:
    def __init__(self, log):
        self.log = log

    def cuda(self, index):
        self.log.append(("storage.cuda", index))
        return self


def test_received_cuda_storages_are_placed_on_this_ranks_device(cuda):
    from hvps.adapters.torch import functions

    storage = FakeStorage(cuda.log)
    assert functions.placer("cuda:2")(storage, "cuda:0") is storage
    assert functions.placer("cpu")(storage, "cuda:0") is storage
    assert functions.placer("cuda:2")(storage, "cpu") is storage
    assert [item for item in cuda.log if item[0] == "storage.cuda"] == [("storage.cuda", 2)]
    devices.reset(local_rank=1)
    assert functions.rank_device() == "cuda:1"
    devices.check("w", [cuda.tensor(3)])
    assert functions.rank_device() == "cuda:3"


def test_object_round_trip_keeps_tensors_and_values():
    from hvps.adapters.torch import functions

    state = {"state": {0: {"momentum_buffer": torch.arange(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    back = functions._loads(functions._dumps(state), "cpu")
    assert torch.equal(back["state"][0]["momentum_buffer"], torch.arange(3.0))
    assert back["param_groups"] == state["param_groups"]


# -- finding 4: NCCL's asynchronous errors and timeouts reach hvps, named; a lost rank aborts NCCL --------
class FakeWork:
    """A ProcessGroupNCCL Work as NCCL leaves it: done when its end event has fired, or failed."""

    def __init__(self):
        self.completed, self.error = False, None

    def is_completed(self):
        return self.completed

    def exception(self):
        return self.error


def test_nccl_watch_times_a_collective_from_its_turn_on_the_gpu_not_from_enqueue():
    from hvps.dataplane.backends.tdist import NcclWatch

    aborted = []
    watch = NcclWatch(10.0, lambda: aborted.append(True), rank=1)
    first, second = FakeWork(), FakeWork()
    watch._thread = True  # checked by hand here, no thread
    watch.track("allreduce", "allreduce.a", first)
    watch.track("allgather", "allgather.b", second)
    assert watch.check(now=0.0) is None
    assert watch.check(now=9.0) is None
    first.completed = True  # the GPU reaches the second at t=9: a deep queue is no failure
    assert watch.check(now=9.0) is None
    assert watch.check(now=18.0) is None  # 18 s after enqueue, 9 s after its turn
    error = watch.check(now=19.5)
    assert isinstance(error, HvpsError)
    assert "NCCL allgather 'allgather.b'" in str(error) and "rank 1" in str(error) and "10 s" in str(error)
    second.completed = True
    assert watch.check(now=30.0) is None and not aborted


def test_nccl_watch_names_an_asynchronous_error_aborts_and_fails_the_engine():
    from hvps.dataplane.backends.tdist import NcclWatch

    aborted, failures, reported = [], [], __import__("threading").Event()
    watch = NcclWatch(60.0, lambda: aborted.append(True), rank=0, interval=0.01)
    watch.failed = lambda error: (failures.append(error), reported.set())
    work = FakeWork()
    watch.track("reducescatter", "reducescatter.grads", work)
    work.error = RuntimeError("NCCL error: remote process exited or there was a network error")
    assert reported.wait(30), "the watch never reported the failed NCCL work"
    assert aborted == [True]
    assert "NCCL reducescatter 'reducescatter.grads' failed on rank 0" in str(failures[0])
    assert "remote process exited" in str(failures[0])


def test_a_rank_lost_on_the_control_plane_aborts_the_nccl_groups():
    import threading

    from hvps.dataplane.backends.tdist import NcclWatch

    aborted = []
    watch = NcclWatch(60.0, lambda: aborted.append(True))
    watch.lost = threading.Event()
    watch._thread = True
    watch.track("allreduce", "allreduce.x", FakeWork())
    assert watch.check(1.0) is None and not aborted
    watch.lost.set()
    assert watch.check(2.0) is None and watch.check(3.0) is None
    assert aborted == [True]  # once


def test_torch_nccl_watchdog_settings_are_hvps_own_and_the_users_win(monkeypatch):
    import os

    from hvps.dataplane.backends import tdist

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    with tdist._TorchNcclSettings():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # never torch's default 3 (kills the process)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    with tdist._TorchNcclSettings():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


# -- finding 6: staged CUDA gradients are copied asynchronously; the engine, not autograd, waits ----------
def test_the_engine_waits_for_asynchronous_staging_copies_before_it_reads_them(cuda):
    from hvps.control.negotiation import BARRIER

    copied = cuda.event()
    entry = Entry(Request("s", BARRIER), [], [], handle=Handle("s"), host_ready=(copied,))
    assert executors.EXECUTORS[BARRIER](Context(None, 0, 1), Response(BARRIER, ["s"]), [entry]) == [None]
    assert ("event.synchronize", copied.label) in cuda.log
