"""GPU-path measurements for ``benchmarks/gpu_check.sh`` (issue 43), at world size 1, one GPU.

  python benchmarks/gpu_paths.py census --json census.json
      host syncs per training step, per data plane and compressor: each configuration in its own
      process (``HVPS_BACKEND`` is read at init), a small MLP, 3 warm-up steps, then 5 steps under
      ``torch.cuda.set_sync_debug_mode("warn")``, counting torch's synchronisation warnings (any
      thread). Target: 0 on the NCCL path without compression.
  python benchmarks/gpu_paths.py speed --json speed.json [--model resnet50|small] [--steps N]
      hvps's DistributedOptimizer against DDP (NCCL, world size 1) and a plain loop, in alternating
      rounds in this process: ms per step, the overhead in microseconds per parameter against the
      plain loop, and GPU idle time per step (wall time minus the CUDA kernel time torch.profiler
      records). Targets: hvps >= 0.97x plain and >= DDP in steps per second.

Without CUDA each subcommand prints why and exits 0 with ``{"skipped": reason}`` in its JSON.
Runs from the checkout (``PYTHONPATH=.``) with only torch, numpy and mpi4py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CENSUS = [  # (label, HVPS_BACKEND, compression)
    ("nccl", "tdist", "none"),
    ("nccl+fp16", "tdist", "fp16"),
    ("nccl+int8", "tdist", "int8"),
    ("nccl+topk", "tdist", "topk"),
    ("nccl+powersgd", "tdist", "powersgd"),
    ("auto", "auto", "none"),
    ("mpi", "mpi", "none"),
]


def _write(path: str, data: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))


def _no_cuda() -> str:
    import torch

    return "" if torch.cuda.is_available() else f"no CUDA GPU: torch {torch.__version__} sees none"


# -- census ------------------------------------------------------------------------------------------
def census_one(compression: str) -> dict:
    """In this process (HVPS_BACKEND already set): syncs per step after warm-up."""
    import torch

    import hvps.adapters.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)]).cuda()
    comp = getattr(hvd.Compression, compression, None)
    kwargs = {} if comp is None else {"compression": comp}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), **kwargs)
    x = torch.randn(64, 512, device="cuda")

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps = 5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    backend = __import__("hvps").runtime.state.engine().backend.name
    hvd.shutdown()
    return {"backend": backend, "compression": compression, "steps": steps, "syncs": len(syncs),
            "syncs_per_step": len(syncs) / steps, "examples": sorted(set(syncs))[:3]}


def census(args) -> int:
    reason = _no_cuda()
    if reason:
        _write(args.json, {"skipped": reason})
        return 0
    rows = []
    for label, backend, compression in CENSUS:
        env = dict(os.environ, HVPS_BACKEND=backend, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        proc = subprocess.run([sys.executable, __file__, "census-one", "--compression", compression], env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        line = next((out for out in reversed(proc.stdout.splitlines()) if out.startswith("{")), None)
        row = {"label": label, "exit_status": proc.returncode}
        if line:
            row.update(json.loads(line))
        else:
            row["error"] = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        rows.append(row)
        print(f"{label}: {row.get('syncs_per_step', 'n/a')} syncs per step", flush=True)
    nccl = next(r for r in rows if r["label"] == "nccl")
    _write(args.json, {"rows": rows, "nccl_syncs_per_step": nccl.get("syncs_per_step"),
                       "target_met": nccl.get("syncs_per_step") == 0})
    return 0 if nccl.get("syncs_per_step") == 0 else 1


# -- speed -------------------------------------------------------------------------------------------
def _small_model():
    import torch

    # about 300 small parameters (150 layers of 16x16 weights and biases)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(150)])


def speed(args) -> int:
    reason = _no_cuda()
    if reason:
        _write(args.json, {"skipped": reason})
        return 0
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import hvps.adapters.torch as hvd
    from benchmarks.resnet import resnet50

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.manual_seed(0)
    if args.model == "resnet50":
        make = lambda: resnet50().cuda().to(memory_format=torch.channels_last)  # noqa: E731
        data = torch.randn(args.batch_size, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
        target = torch.randint(0, 1000, (args.batch_size,), device="cuda")
        loss_of = lambda out: torch.nn.functional.cross_entropy(out, target)  # noqa: E731
    else:
        make = lambda: _small_model().cuda()  # noqa: E731
        data = torch.randn(args.batch_size, 16, device="cuda")
        loss_of = lambda out: out.square().mean()  # noqa: E731

    def contender(kind):
        model = make()
        params = sum(1 for _ in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if kind == "hvps":
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        if kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])

        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.model == "resnet50"):
                loss = loss_of(model(data))
            loss.backward()
            opt.step()

        return step, params

    contenders = {kind: contender(kind) for kind in ("plain", "ddp", "hvps")}
    for step, _ in contenders.values():
        for _ in range(args.warmup):
            step()
    torch.cuda.synchronize()
    times = {kind: [] for kind in contenders}
    idle = {}
    for _round in range(args.rounds):
        for kind, (step, _) in contenders.items():  # alternating rounds
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(args.steps):
                step()
            end.record()
            end.synchronize()
            times[kind].append((time.perf_counter() - t0) / args.steps * 1e3)
    for kind, (step, _) in contenders.items():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / 3 * 1e6
        kernels = sum(e.self_device_time_total for e in prof.key_averages()) / 3
        idle[kind] = {"wall_us_per_step": wall, "kernel_us_per_step": kernels,
                      "gpu_idle_us_per_step": max(0.0, wall - kernels)}
    best = {kind: min(v) for kind, v in times.items()}
    params = contenders["hvps"][1]
    result = {"model": args.model, "batch_size": args.batch_size, "parameters": params, "ms_per_step": times,
              "best_ms_per_step": best, "gpu_idle": idle,
              "hvps_us_per_parameter_vs_plain": (best["hvps"] - best["plain"]) * 1e3 / params,
              "ddp_us_per_parameter_vs_plain": (best["ddp"] - best["plain"]) * 1e3 / params,
              "hvps_speed_vs_plain": best["plain"] / best["hvps"], "hvps_speed_vs_ddp": best["ddp"] / best["hvps"]}
    result["target_met"] = result["hvps_speed_vs_plain"] >= 0.97 and result["hvps_speed_vs_ddp"] >= 1.0
    dist.destroy_process_group()
    _write(args.json, result)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("census")
    c.add_argument("--json", default="")
    c.add_argument("--timeout", type=float, default=120)
    one = sub.add_parser("census-one")
    one.add_argument("--compression", default="none")
    s = sub.add_parser("speed")
    s.add_argument("--json", default="")
    s.add_argument("--model", choices=("resnet50", "small"), default="resnet50")
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--warmup", type=int, default=5)
    s.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.command == "census-one":
        print(json.dumps(census_one(args.compression)))
        return 0
    return census(args) if args.command == "census" else speed(args)


if __name__ == "__main__":
    sys.exit(main())
