"""Step-gap benchmark (issue 14): one ResNet-50 training step (forward,
cross-entropy, backward, ``optimizer.step()``; SGD lr 0.01, momentum 0.9,
synthetic data) under hvps, with no communication, and under torch DDP, next to
one raw ``MPI.Allreduce`` of the model's bytes. Four contenders, each in an
``mpirun`` job of its own, alternating A B C D A B C D ... over rounds:

* ``hvps``:   ``hvd.DistributedOptimizer``, parameters broadcast from rank 0 first
* ``nocomm``: the same ranks launched together with a plain optimizer: the
              machine's ceiling with as many processes competing for cores
* ``ddp``:    ``torch.nn.parallel.DistributedDataParallel`` on gloo
              (rank/size from mpi4py, MASTER_PORT picked by rank 0 and broadcast)
* ``raw``:    barrier; t0; one in-place float32 SUM ``comm.Allreduce`` of
              25,557,032 elements (97.5 MiB); t1

Each step starts after a barrier; per step the slowest rank's time counts, per
job the median over the timed steps, per contender the median over rounds.

    gap_ratio      = (hvps - nocomm) / raw   per round, median   (target <= 1.5)
    hvps_vs_ddp    = ddp / hvps              throughput ratio    (target >= 1.15)
    hvps_vs_nocomm = nocomm / hvps                               (target >= 0.97 at 224 px)

    python benchmarks/step_gap.py --np 2 --rounds 3 --json out/step_gap.json
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import DEFAULT_MPIRUN_ARGS, MPIRUN_HELP, dispatch, median, run_mpi_worker, summarize, write_json

IMPLS = ("hvps", "nocomm", "ddp", "raw")
TARGETS = {"gap_ratio": "<= 1.5", "hvps_vs_ddp": ">= 1.15", "hvps_vs_nocomm": ">= 0.97 (224 px)"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="worker mode (internal): time this contender (run under mpirun)")
    p.add_argument("--np", type=int, default=2, help="driver: ranks per job (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="driver: rounds of alternating jobs; medians over rounds (default: %(default)s)")
    p.add_argument("--iters", type=int, default=6, help="timed steps (raw: allreduces) per job (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per job before timing (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="images per rank per step (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=128, help="synthetic image height and width in pixels "
                   "(default: %(default)s)")
    p.add_argument("--threads-per-rank", type=int, default=1,
                   help="torch intra-op threads per rank (default: %(default)s)")
    p.add_argument("--contenders", default=",".join(IMPLS),
                   help="driver: comma list of contenders to run, in this order each round; the ratios need "
                   "hvps, nocomm, ddp and raw (default: %(default)s)")
    p.add_argument("--mpirun", default=None, help="driver: " + MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS,
                   help="driver: extra mpirun flags (default: '%(default)s')")
    p.add_argument("--timeout", type=float, default=1800, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="write results as JSON to this path (driver: all per-round values, "
                   "the command line and host facts; worker: rank 0's job result)")
    p.add_argument("--verbose", action="store_true", help="driver: echo each mpirun command")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker
def _ddp_init(comm, rank: int, size: int) -> None:
    """torch.distributed on gloo from the MPI world: rank 0 picks a free port, broadcasts it."""
    import torch.distributed as dist

    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)


def run_worker(args: argparse.Namespace) -> None:
    """Time one contender; rank 0 writes ``{"impl", "times_s", "stats", ...}`` JSON."""
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from benchmarks.resnet import resnet50

    torch.set_num_threads(args.threads_per_rank)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(1234 + rank)  # ranks start apart: the broadcasts matter
    model = resnet50()
    numel = sum(p.numel() for p in model.parameters())
    hvd = None

    if args.impl == "raw":
        buf = np.random.default_rng(rank).standard_normal(numel, dtype=np.float32)

        def one_step() -> None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        if args.impl == "ddp":
            _ddp_init(comm, rank, size)
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if args.impl == "hvps":
            import hvps.adapters.torch as hvd
            hvd.init()
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        gen = torch.Generator().manual_seed(rank)
        data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
        target = torch.randint(0, 1000, (args.batch_size,), generator=gen)

        def one_step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(data), target).backward()
            opt.step()

    times = np.empty(args.iters)
    for i in range(args.warmup + args.iters):
        comm.Barrier()
        t0 = time.perf_counter()
        one_step()
        if i >= args.warmup:
            times[i - args.warmup] = time.perf_counter() - t0
    slowest = np.empty_like(times) if rank == 0 else None
    comm.Reduce(times, slowest, op=MPI.MAX, root=0)
    if rank == 0:
        stats = summarize(slowest)
        write_json(args.json, {"impl": args.impl, "ranks": size, "numel": numel, "bytes": numel * 4,
                               "times_s": slowest.tolist(), "stats": stats})
    if args.impl == "ddp":
        torch.distributed.destroy_process_group()
    if hvd is not None and hasattr(hvd, "shutdown"):
        hvd.shutdown()


# ----------------------------------------------------------------------------- driver
def _host_facts() -> dict:
    import torch

    return {"hostname": platform.node(), "nproc": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def run_driver(args: argparse.Namespace) -> dict:
    """Alternate the contenders' jobs over rounds; report step medians and the derived ratios."""
    impls = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown or not impls:
        sys.exit(f"--contenders: unknown {unknown}; choose from {','.join(IMPLS)}")
    common_args = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                   "--image-size", str(args.image_size), "--threads-per-rank", str(args.threads_per_rank)]
    host_before = _host_facts()
    runs: dict[str, list[float]] = {impl: [] for impl in impls}
    jobs: dict[str, list[dict]] = {impl: [] for impl in impls}
    for rnd in range(args.rounds):
        for impl in impls:
            print(f"round {rnd + 1}/{args.rounds}: {impl} ...", flush=True)
            res = run_mpi_worker(args.np, __file__, ["--impl", impl, *common_args], mpirun=args.mpirun,
                                 mpirun_args=args.mpirun_args, timeout=args.timeout, verbose=args.verbose)
            runs[impl].append(res["stats"]["median"])
            jobs[impl].append({"times_s": res["times_s"], "stats": res["stats"]})
            print(f"  {impl}: median {res['stats']['median'] * 1e3:.1f} ms", flush=True)
    med = {impl: median(v) for impl, v in runs.items()}
    per_round: dict[str, list[float]] = {}
    if {"hvps", "nocomm", "raw"} <= set(impls):
        per_round["gap_ratio"] = [(h - n) / r for h, n, r in zip(runs["hvps"], runs["nocomm"], runs["raw"])]
    if {"hvps", "ddp"} <= set(impls):
        per_round["hvps_vs_ddp"] = [d / h for d, h in zip(runs["ddp"], runs["hvps"])]
    if {"hvps", "nocomm"} <= set(impls):
        per_round["hvps_vs_nocomm"] = [n / h for n, h in zip(runs["nocomm"], runs["hvps"])]
    derived = {k: median(v) for k, v in per_round.items()}
    result = {"benchmark": "step_gap", "command": [sys.executable, *sys.argv], "ranks": args.np,
              "rounds": args.rounds, "iters": args.iters, "warmup": args.warmup, "batch_size": args.batch_size,
              "image_size": args.image_size, "threads_per_rank": args.threads_per_rank,
              "mpirun_args": args.mpirun_args, "contenders": impls,
              "host": host_before, "loadavg_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "median_s": med, "per_round_s": runs, "jobs": jobs,
              **derived, "per_round": per_round, "targets": {k: TARGETS[k] for k in derived}}
    print(f"\n# step gap: ResNet-50, {args.np} ranks x {args.threads_per_rank} thread(s), batch {args.batch_size}, "
          f"{args.image_size} px, {args.iters} steps/job, medians over {args.rounds} round(s), "
          f"nproc {host_before['nproc']}")
    labels = {"hvps": "hvps step", "nocomm": "no-comm step", "ddp": "DDP (gloo) step", "raw": "raw Allreduce 97.5 MiB"}
    for impl in impls:
        print(f"{labels[impl]:<24}{med[impl] * 1e3:10.1f} ms   (per round "
              + ", ".join(f"{v * 1e3:.1f}" for v in runs[impl]) + ")")
    for key, value in derived.items():
        print(f"{key:<24}{value:10.3f}      (target {TARGETS[key]}; per round "
              + ", ".join(f"{v:.3f}" for v in per_round[key]) + ")")
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None) -> None:
    dispatch(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    main()
