"""Tensor-fusion benchmark: ResNet-50's 161 gradients through
``hvd.DistributedOptimizer`` vs one raw ``MPI.Allreduce`` of the same bytes.

Gradients come from a real backward of the surrogate loss
``sum((p * r).sum() for p in params)`` (gradient of p is the fixed random r),
so the optimizer's hooks fire one by one in reverse order as in backprop.
Three contenders, each in processes of its own, alternating over rounds:

* ``hvps``:     barrier; t0; loss.backward(); optimizer.synchronize(); t1
* ``backward``: the same backward with a plain optimizer and no hvps at all
* ``raw``:      one ``comm.Allreduce`` of a float32 buffer of 25,557,032 elements

Per call the slowest rank's time counts; per job the median over calls.
Fusion overhead ratio = (hvps - backward) / raw, taken per round and reported
as the median over rounds (target <= 1.25).

    python benchmarks/fusion.py --np 2 --rounds 5 --json out/fusion.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import DEFAULT_MPIRUN_ARGS, MPIRUN_HELP, dispatch, median, run_mpi_worker, summarize, write_json  # noqa: E402

IMPLS = ("hvps", "backward", "raw")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="worker mode: time this contender (run under mpirun)")
    p.add_argument("--np", type=int, default=2, help="driver: ranks per job (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5,
                   help="driver: rounds of alternating jobs; medians over rounds (default: %(default)s)")
    p.add_argument("--iters", type=int, default=10, help="timed calls per job (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per job (default: %(default)s)")
    p.add_argument("--algorithm", choices=("mpi", "ring"), default=None,
                   help="set HVPS_ALLREDUCE_ALGORITHM for the hvps jobs (default: hvps's own default)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per rank for the backward (default: %(default)s)")
    p.add_argument("--mpirun", default=None, help="driver: " + MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS,
                   help="driver: extra mpirun flags (default: '%(default)s')")
    p.add_argument("--timeout", type=float, default=1800, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="write results as JSON to this path (rank 0 / driver)")
    p.add_argument("--verbose", action="store_true", help="driver: echo each mpirun command")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker
def run_worker(args: argparse.Namespace) -> None:
    """Time one contender; rank 0 writes ``{"impl", "times_s", ...}`` JSON."""
    import torch
    from mpi4py import MPI

    from benchmarks.resnet import resnet50

    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    model = resnet50()
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    gen = torch.Generator().manual_seed(1234 + rank)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    correct = None

    if args.impl == "raw":
        send = np.random.default_rng(rank).standard_normal(numel, dtype=np.float32)
        recv = np.empty_like(send)

        def one_call() -> float:
            t0 = time.perf_counter()
            comm.Allreduce(send, recv, op=MPI.SUM)
            return time.perf_counter() - t0
    else:
        if args.impl == "hvps":
            import hvps.adapters.torch as hvd
            hvd.init()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0),
                                           named_parameters=model.named_parameters(),
                                           compression=hvd.Compression.none)
        else:
            opt = torch.optim.SGD(params, lr=0.0)

        def one_call() -> float:
            loss = sum((p * r).sum() for p, r in zip(params, grads))
            t0 = time.perf_counter()
            loss.backward()
            if args.impl == "hvps":
                opt.synchronize()
            return time.perf_counter() - t0

        if args.impl == "hvps":  # check once that the grads are the rank average of r
            one_call()
            expected = [torch.zeros_like(p) for p in params]
            for k in range(size):
                g = torch.Generator().manual_seed(1234 + k)
                for e, p in zip(expected, params):
                    e += torch.randn(p.shape, generator=g) / size
            correct = all(torch.allclose(p.grad, e, rtol=1e-4, atol=1e-5) for p, e in zip(params, expected))
            correct = comm.allreduce(correct, op=MPI.LAND)
            _finish_step(opt, args.impl)

    times = np.empty(args.iters)
    for i in range(args.warmup + args.iters):
        comm.Barrier()
        elapsed = one_call()
        if args.impl != "raw":
            _finish_step(opt, args.impl)
        if i >= args.warmup:
            times[i - args.warmup] = elapsed
    slowest = np.empty_like(times) if rank == 0 else None
    comm.Reduce(times, slowest, op=MPI.MAX, root=0)
    if rank == 0:
        stats = summarize(slowest)
        print(f"# fusion {args.impl}: {size} ranks, {len(params)} tensors, {numel * 4 / 2**20:.1f} MiB, "
              f"median {stats['median'] * 1e3:.2f} ms, mean {stats['mean'] * 1e3:.2f} ms"
              + ("" if correct in (None, True) else "  WRONG RESULT"), flush=True)
        write_json(args.json, {"impl": args.impl, "ranks": size, "tensors": len(params), "numel": numel,
                               "bytes": numel * 4, "correct": correct, "times_s": slowest.tolist(),
                               "stats": stats})


def _finish_step(opt, impl: str) -> None:
    """Step (lr=0) with Horovod's skip_synchronize pattern, then drop the grads."""
    if impl == "hvps":
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    opt.zero_grad()


# ----------------------------------------------------------------------------- driver
def run_driver(args: argparse.Namespace) -> dict:
    """Alternate hvps / backward / raw jobs; report the median fusion ratio."""
    common_args = ["--iters", str(args.iters), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    env = {"HVPS_ALLREDUCE_ALGORITHM": args.algorithm} if args.algorithm else {}
    runs: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    correct = True
    for rnd in range(args.rounds):
        for impl in IMPLS:
            print(f"round {rnd + 1}/{args.rounds}: {impl} ...", flush=True)
            res = run_mpi_worker(args.np, __file__, ["--impl", impl, *common_args],
                                 env=env if impl == "hvps" else None, mpirun=args.mpirun,
                                 mpirun_args=args.mpirun_args, timeout=args.timeout, verbose=args.verbose)
            runs[impl].append(res["stats"]["median"])
            correct = correct and res["correct"] is not False
            total_bytes = res["bytes"]
    ratios = [(h - b) / r for h, b, r in zip(runs["hvps"], runs["backward"], runs["raw"])]
    med = {impl: median(v) for impl, v in runs.items()}
    result = {"benchmark": "fusion", "ranks": args.np, "tensors": 161, "bytes": total_bytes,
              "rounds": args.rounds, "iters": args.iters, "algorithm": args.algorithm or os.environ.get(
                  "HVPS_ALLREDUCE_ALGORITHM", "default"), "correct": correct,
              "per_round_s": runs, "median_s": med,
              "hvps_net_s": med["hvps"] - med["backward"],
              "ratio": median(ratios), "per_round_ratio": ratios,
              "ratio_of_medians": (med["hvps"] - med["backward"]) / med["raw"], "target": 1.25}
    print(f"\n# fusion: {args.np} ranks, 161 tensors, {total_bytes / 2**20:.1f} MiB, medians over {args.rounds} rounds")
    print(f"backward+synchronize (hvps) {med['hvps'] * 1e3:9.2f} ms")
    print(f"backward alone              {med['backward'] * 1e3:9.2f} ms")
    print(f"hvps net                    {result['hvps_net_s'] * 1e3:9.2f} ms")
    print(f"raw Allreduce, same bytes   {med['raw'] * 1e3:9.2f} ms")
    print(f"ratio (hvps net / raw)      {result['ratio']:9.3f}  (target <= 1.25; per round "
          + ", ".join(f"{r:.3f}" for r in ratios) + ")" + ("" if correct else "  WRONG RESULT"))
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None) -> None:
    dispatch(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    main()
