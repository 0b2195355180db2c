"""CUDA tensors end to end, with 1 rank (``benchmarks/gpu_check.sh`` runs these on a GPU machine).

Each test runs a script in a fresh process (hvps as an MPI singleton) so that
backends and CUDA state never leak between tests. Results are checked against
numpy references computed from the same inputs.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason=f"no CUDA GPU: torch {torch.__version__} sees none (CPU build or no device); "
               "benchmarks/gpu_check.sh runs these on a GPU machine",
    ),
]


def _run(body: str, check: bool = True, **env) -> str:
    code = "import numpy as np, torch, hvps\nimport hvps.adapters.torch as hvd\n" + textwrap.dedent(body)
    full = dict(os.environ, PYTHONPATH=str(REPO_ROOT), **env)
    proc = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=280)
    # check=False: the script ends a failed engine, which ends the job at exit (MPI's abort)
    assert proc.returncode == 0 or not check, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout + proc.stderr


def test_nccl_collectives_on_cuda_tensors_match_numpy():
    out = _run("""
        hvd.init()
        torch.cuda.set_device(hvd.local_rank())
        assert hvps.runtime.state.engine().backend.name == "tdist"
        g = torch.Generator(device="cuda").manual_seed(1)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                      torch.uint8, torch.bool):
            for n in (0, 1, 7, 1_000_003):
                x = (torch.rand(n, device="cuda", generator=g) * 100).to(dtype)
                ref = x.cpu()
                for op in (hvd.Sum, hvd.Min, hvd.Max):
                    y = hvd.allreduce(x, op=op, name=f"{dtype}.{n}.{op}")
                    assert y.device.type == "cuda", y.device
                    assert torch.equal(y.cpu(), ref), (dtype, n, op)
                if dtype.is_floating_point:
                    avg = hvd.allreduce(x, op=hvd.Average, name=f"avg.{dtype}.{n}", prescale_factor=0.5,
                                        postscale_factor=4.0)
                    torch.testing.assert_close(avg.cpu(), (ref.float() * 2.0).to(dtype))
        b = torch.arange(10, device="cuda", dtype=torch.float32)
        hvd.broadcast_(b, 0)
        assert torch.equal(hvd.allgather(b).cpu(), torch.arange(10.0))
        print("ok")
    """, HVPS_BACKEND="tdist")
    assert "ok" in out


def test_collective_waits_for_the_producing_stream():
    # The input is written on a side stream by a slow kernel chain: the allreduce must see the
    # final values (ready event), and the consumer stream must see the result (done event).
    out = _run("""
        hvd.init()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            m = torch.randn(2048, 2048, device="cuda")
            for _ in range(50):
                m = torch.tanh(m @ m)  # bounded: slow, and never inf or nan
            x = torch.full((4_000_000,), 3.0, device="cuda") + m.sum() * 0
            handle = hvd.allreduce_async_(x, op=hvd.Sum, name="ordered")
            hvd.synchronize(handle)
            y = x * 2
        torch.cuda.synchronize()
        assert torch.all(y == 6.0).item()
        print("ok")
    """, HVPS_BACKEND="tdist")
    assert "ok" in out


def test_fused_gradients_and_fp16_compression_stay_on_the_gpu():
    out = _run("""
        hvd.init()
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)]).cuda()
        reference = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)]).cuda()
        reference.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hvd.Compression.fp16)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        x = torch.randn(32, 64, device="cuda")
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            net(x).square().mean().backward()
            optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert p.device.type == "cuda"
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-3)  # fp16 on the wire
        print("ok")
    """, HVPS_BACKEND="tdist")
    assert "ok" in out


def test_auto_sends_cuda_tensors_over_nccl_and_host_arrays_over_mpi():
    out = _run("""
        hvd.init()
        backend = hvps.runtime.state.engine().backend
        assert backend.name == "auto", backend.name
        y = hvd.allreduce(torch.ones(5, device="cuda"), op=hvd.Sum)
        assert y.device.type == "cuda" and torch.equal(y.cpu(), torch.ones(5))
        assert np.array_equal(hvps.allreduce(np.arange(5.0), op=hvps.Sum), np.arange(5.0))
        assert "cuda" in backend.device._groups and "cpu" not in backend.device._groups
        print("ok")
    """, HVPS_BACKEND="auto")
    assert "ok" in out


def test_mpi_backend_stages_cuda_tensors_through_host_memory_with_one_warning():
    out = _run("""
        hvd.init()
        if hvps.runtime.state.engine().backend.takes("cuda", "float32"):
            print("cuda-aware")
        for i in range(3):
            x = torch.randn(1000, device="cuda")
            y = hvd.allreduce(x, op=hvd.Sum, name=f"staged.{i}")
            assert y.device.type == "cuda" and torch.equal(y, x)
        print("ok")
    """, HVPS_BACKEND="mpi")
    assert "ok" in out
    if "cuda-aware" not in out:
        assert out.count("staged through pinned host memory") == 1, out


# -- stream ordering that can fail (issue 43, finding 5) ------------------------------------------------
# The producer writes the input on a side stream behind a ~0.2 s sleep kernel; the collective changes the
# values (prescale, or a copy into a new tensor); the consumer reads the result on a third stream. A
# missing ready event reduces the stale input (zeros); a missing done event lets the consumer read the
# output before the collective wrote it. Each runs under TORCH_CUDA_SANITIZER=1 in gpu_check.sh too.
ORDERING = """
    hvd.init()
    torch.cuda.set_device(0)
    SLEEP = 400_000_000  # GPU cycles (~0.2 s): long enough that any missing wait reads stale memory
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()

    def produced(n, value, rows=None):
        x = torch.zeros((rows, n) if rows else (n,), device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SLEEP)
            x.fill_(value)
        return x

    def consumed(handle):
        with torch.cuda.stream(consumer):
            out = hvd.synchronize(handle)
            out = out[0] if isinstance(out, tuple) else out
            return (out * 1).cpu()  # read on the consumer stream (the .cpu() syncs only that stream)

    results = {}
    # allreduce, out of place, prescale 3: 3 * 2 = 6 only when both events are honoured
    x = produced(1 << 20, 2.0)
    with torch.cuda.stream(producer):
        h = hvd.allreduce_async(x, op=hvd.Sum, prescale_factor=3.0, name="ord.allreduce")
    results["allreduce"] = consumed(h)
    assert torch.all(results["allreduce"] == 6.0), results["allreduce"].unique()
    # in place, fused with a second tensor (fusion buffer pack and unpack on the engine stream)
    a, b = produced(1 << 18, 1.0), produced(1 << 18, 5.0)
    with torch.cuda.stream(producer):
        h = hvd.grouped_allreduce_async_([a, b], op=hvd.Sum, postscale_factor=2.0, name="ord.grouped")
    with torch.cuda.stream(consumer):
        outs = hvd.synchronize(h)
        total = torch.stack([outs[0].sum(), outs[1].sum()]).cpu()
    assert total.tolist() == [2.0 * (1 << 18), 10.0 * (1 << 18)], total
    # allgather: a new tensor holding the producer's values
    x = produced(4096, 4.0, rows=3)
    with torch.cuda.stream(producer):
        h = hvd.allgather_async(x, name="ord.allgather")
    got = consumed(h)
    assert got.shape == (3, 4096) and torch.all(got == 4.0), got.unique()
    # reducescatter (Sum, prescale 0.5): a new tensor of half the values
    x = produced(4096, 8.0, rows=2)
    with torch.cuda.stream(producer):
        h = hvd.reducescatter_async(x, op=hvd.Sum, prescale_factor=0.5, name="ord.reducescatter")
    got = consumed(h)
    assert torch.all(got == 4.0), got.unique()
    # alltoall: a new tensor, the producer's values
    x = produced(4096, 9.0, rows=2)
    with torch.cuda.stream(producer):
        h = hvd.alltoall_async(x, name="ord.alltoall")
    got = consumed(h)
    assert torch.all(got == 9.0), got.unique()
    # poll() is true once the GPU has finished (its CPU side: tests/test_gpu_paths.py)
    x = produced(1 << 20, 1.0)
    with torch.cuda.stream(producer):
        h = hvd.allreduce_async(x, op=hvd.Sum, name="ord.poll")
    torch.cuda.synchronize()
    hvd.synchronize(h)
    assert hvd.poll(h)
    print("ok")
"""


@pytest.mark.parametrize("backend", ["tdist", "mpi"])
def test_ordering_with_a_delayed_producer_and_a_consumer_on_another_stream(backend):
    # mpi: the CUDA-aware MPI path when there is one (its race, finding 3), else staging through the host
    out = _run(ORDERING, HVPS_BACKEND=backend)
    assert "ok" in out


def test_nccl_path_makes_no_host_sync_after_warm_up():
    # torch.cuda.set_sync_debug_mode("error") turns every host sync (on any thread) into an error
    out = _run("""
        hvd.init()
        torch.cuda.set_device(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters())
        x = torch.randn(64, 256, device="cuda")
        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(5):
            step()
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        print("ok")
    """, HVPS_BACKEND="tdist")
    assert "ok" in out


def test_joined_rank_and_received_state_stay_on_the_ranks_gpu():
    # at world size 1 the device is cuda:0 either way: what is checked is that join(device) runs on
    # CUDA and that broadcast_object returns CUDA tensors on this rank's device
    out = _run("""
        hvd.init()
        torch.cuda.set_device(0)
        y = hvd.allreduce(torch.ones(4, device="cuda"), op=hvd.Sum, name="before")
        assert hvd.join(0) == 0
        state = hvd.broadcast_object({"m": torch.arange(3.0, device="cuda")}, 0)
        assert state["m"].device == torch.device("cuda", 0)
        from hvps.adapters.torch import functions
        assert functions.rank_device() == "cuda:0"
        print("ok")
    """, HVPS_BACKEND="tdist")
    assert "ok" in out


def test_sync_batch_norm_uses_fused_kernels_matches_batch_norm_and_never_syncs():
    out = _run("""
        hvd.init()
        torch.cuda.set_device(0)
        torch.manual_seed(0)
        for shape in ((8, 16, 12, 12), (5, 3), (1, 4, 7)):
            x = torch.randn(*shape, device="cuda", requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            sync = hvd.SyncBatchNorm(shape[1], momentum=0.3).cuda()
            ref = torch.nn.BatchNorm1d(shape[1], momentum=0.3).cuda() if len(shape) < 4 else \\
                torch.nn.BatchNorm2d(shape[1], momentum=0.3).cuda()
            dy = torch.randn(*shape, device="cuda")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # no .item(): not one host sync in forward or backward
            y = sync(x)
            (y * dy).sum().backward()
            torch.cuda.set_sync_debug_mode("default")
            y_ref = ref(x_ref)
            (y_ref * dy).sum().backward()
            torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(sync.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(sync.running_mean, ref.running_mean)
            torch.testing.assert_close(sync.running_var, ref.running_var)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            x = torch.randn(16, 32, 8, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            sync = hvd.SyncBatchNorm(32).cuda()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            y = sync(x)
            peak = torch.cuda.max_memory_allocated() - base
            assert peak <= 3 * x.numel() * x.element_size(), peak  # no float64 copies of the activation
            y.float().sum().backward()
        print("ok")
    """, HVPS_BACKEND="tdist")
    assert "ok" in out


def test_nccl_works_are_watched_and_an_aborted_communicator_fails_with_an_hvps_error():
    out = _run("""
        import time
        hvd.init()
        torch.cuda.set_device(0)
        backend = hvps.runtime.state.engine().backend
        hvd.allreduce(torch.ones(1024, device="cuda"), op=hvd.Sum, name="watched")
        torch.cuda.synchronize()
        deadline = time.monotonic() + 30
        while backend.watch._works and time.monotonic() < deadline:  # real Works: is_completed, exception
            time.sleep(0.05)
        assert not backend.watch._works, "finished NCCL works stay tracked"
        backend.watch.abort()  # what the watch does on an NCCL error or timeout, or a lost rank
        try:
            hvd.allreduce(torch.ones(4, device="cuda"), op=hvd.Sum, name="after.abort")
            torch.cuda.synchronize()
        except hvps.HvpsError as exc:
            print("raised:", exc)
        print("ok")
    """, check=False, HVPS_BACKEND="tdist", HVPS_STALL_CHECK_TIME_SECONDS="20")
    assert "ok" in out and "raised:" in out and "after.abort" in out


def test_staged_gradients_are_copied_asynchronously_and_still_reduce_exactly():
    # HVPS_BACKEND=mpi: without a CUDA-aware MPI each gradient is staged through pinned memory by an
    # asynchronous copy that the engine waits for (autograd's thread does not)
    out = _run("""
        hvd.init()
        torch.cuda.set_device(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(10)]).cuda()
        reference = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(10)]).cuda()
        reference.load_state_dict(model.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(64, 128, device="cuda")
            for net, optimizer in ((model, opt), (reference, ref_opt)):
                optimizer.zero_grad()
                net(x).square().mean().backward()
                optimizer.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)
        print("ok")
    """, HVPS_BACKEND="mpi")
    assert "ok" in out


#: the start of the sharded tests' scripts: a small model on the GPU and an unsharded copy with plain Adam
#: (``ref``, ``plain``); ``adam(model)`` makes the same Adam, ``step_both(opt)`` steps both on one batch
_BESIDE_PLAIN_ADAM = textwrap.dedent("""
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(0)
    def net():
        return torch.nn.Sequential(torch.nn.Linear(64, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5)).cuda()
    def adam(m):
        return torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False)
    model, ref = net(), net()
    ref.load_state_dict(model.state_dict())
    plain = adam(ref)
    def step_both(opt):
        x = torch.randn(16, 64, device="cuda")
        for m, o in ((model, opt), (ref, plain)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
""")


def test_sharded_optimizer_on_cuda_matches_the_plain_optimizer():
    # ZeRO stage 1-2 (issue 39) at world size 1 on the GPU: the shard is the whole bucket, so every step must
    # equal plain Adam's bit for bit, with the state and the gradient shards on the device (never the host)
    out = _run(_BESIDE_PLAIN_ADAM + textwrap.dedent("""
        opt = hvd.DistributedOptimizer(adam(model), named_parameters=model.named_parameters(), shard=True)
        for step in range(3):
            step_both(opt)
            for a, b in zip(model.parameters(), ref.parameters()):
                assert a.device.type == "cuda" and torch.equal(a, b), step
        state = opt.state_dict()["state"]
        assert all(v.device.type == "cuda" for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        print("ok")
    """), HVPS_BACKEND="tdist")
    assert "ok" in out


@pytest.mark.parametrize("backend", ["tdist", "mpi"])
def test_fully_sharded_model_on_cuda_matches_the_plain_model(backend):
    # ZeRO stage 3 (issue 39) at world size 1 on the GPU: on NCCL (tdist) each unit is all-gathered straight into
    # its device buffer (allgather's out=), on MPI staged through the host and copied in; either way every step
    # must equal plain Adam's on an unsharded copy bit for bit, the shards and their state on the device
    out = _run(_BESIDE_PLAIN_ADAM + textwrap.dedent("""
        from hvps.adapters.torch.fully_sharded import FullyShardedModel
        hvd.fully_shard(model, units=[model[0], model[2]])
        opt = adam(model)
        for step in range(3):
            step_both(opt)
            with FullyShardedModel.of(model).full_parameters() as full:
                for a, b in zip(full.parameters(), ref.parameters()):
                    assert a.device.type == "cuda" and torch.equal(a, b), step
        assert all(v.device.type == "cuda" for s in opt.state.values() for v in s.values() if v.dim())
        print("ok")
    """), HVPS_BACKEND=backend)
    assert "ok" in out
