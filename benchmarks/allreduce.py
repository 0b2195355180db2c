"""OSU-style allreduce sweep: hvps ``allreduce`` against the data plane it runs on, called directly.

Contenders: ``raw`` (mpi4py ``Allreduce``), ``hvps-mpi`` and ``hvps-ring`` (the
MPI backend), ``hvps-shm`` (the node's shared-memory data plane, ``HVPS_SHM=1``),
``hvps-sealed`` (the sealed data plane, ``HVPS_ENCRYPT=all``: every message sealed, even on one host),
``tdist`` (``torch.distributed.all_reduce`` on a default group:
gloo on CPU, NCCL with ``--device cuda``) and ``hvps-tdist`` (hvps with
``HVPS_BACKEND=tdist`` on the same kind of tensors). Ratios are against
``--reference`` (raw, or tdist when raw is not run).

Driver mode (default, run without mpirun)::

    python benchmarks/allreduce.py --np 2 --json out/allreduce.json
    python benchmarks/allreduce.py --np 2 --sizes 64MiB --rounds 5
    python benchmarks/allreduce.py --np 2 --sizes 64MiB --impls tdist,hvps-tdist
    python benchmarks/allreduce.py --np 1 --sizes 256MiB --impls tdist,hvps-tdist --device cuda

launches, for each of ``--rounds`` rounds, one ``mpirun -np N`` job per
implementation (A B C A B C ...), so every contender is timed in processes of
its own: a busy background thread of one implementation can never slow the
reference. Reports medians over rounds of each job's median per-call time
(per call: the slowest rank's time, calls separated by a barrier, ``MPI.Wtime``),
algbw = bytes/time, busbw = algbw * 2(n-1)/n and hvps/raw ratios, and the CPU time
per byte (ns/B, mean over ranks) of the threads that run the collective (the caller's
for raw and tdist; the caller's plus the ``hvps-engine`` thread's for hvps) and of the whole process.

Worker mode (``--impl NAME``, under mpirun) times one
implementation and prints an OSU-style table from rank 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    DEFAULT_MPIRUN_ARGS,
    MPIRUN_HELP,
    MiB,
    dispatch,
    fmt_bytes,
    log0,
    median,
    parse_size,
    run_mpi_worker,
    torch_default_group,
    write_json,
)

IMPLS = ("raw", "hvps-mpi", "hvps-ring", "hvps-shm", "hvps-sealed", "tdist", "hvps-tdist")
#: contenders that move torch tensors (the others move numpy arrays)
TORCH_IMPLS = ("tdist", "hvps-tdist")
DTYPES = ("float32", "float64", "int32", "int64")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="worker mode: time this implementation (run under mpirun)")
    p.add_argument("--impls", default="raw,hvps-mpi,hvps-ring",
                   help=f"driver: comma-separated implementations to compare, from {', '.join(IMPLS)} "
                        "(default: %(default)s)")
    p.add_argument("--reference", default="",
                   help="driver: the implementation ratios are taken against (default: raw if run, else tdist)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where tdist/hvps-tdist tensors live; cuda uses NCCL, one GPU per rank (default: cpu)")
    p.add_argument("--np", type=int, default=2, help="driver: number of ranks per job (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="driver: rounds of alternating jobs; results are medians over rounds (default: %(default)s)")
    p.add_argument("--min-bytes", type=parse_size, default=4 << 10, help="smallest message, e.g. 4KiB (default: 4 KiB)")
    p.add_argument("--max-bytes", type=parse_size, default=256 * MiB, help="largest message (default: 256 MiB)")
    p.add_argument("--step", type=int, default=4, help="size multiplier between messages (default: %(default)s)")
    p.add_argument("--sizes", default="",
                   help="comma-separated explicit sizes (e.g. 64MiB,1MiB); overrides min/max/step")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type (default: %(default)s)")
    p.add_argument("--iters", type=int, default=100, help="timed calls per small message (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per small message (default: %(default)s)")
    p.add_argument("--iters-large", type=int, default=20,
                   help="timed calls per message >= --large-bytes (default: %(default)s)")
    p.add_argument("--warmup-large", type=int, default=3,
                   help="untimed calls per message >= --large-bytes (default: %(default)s)")
    p.add_argument("--large-bytes", type=parse_size, default=4 * MiB,
                   help="threshold for the *-large iteration counts (default: 4 MiB)")
    p.add_argument("--mpirun", default=None, help="driver: " + MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS,
                   help="driver: extra mpirun flags (default: '%(default)s')")
    p.add_argument("--timeout", type=float, default=1800, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="write results as JSON to this path (rank 0 / driver)")
    p.add_argument("--verbose", action="store_true", help="driver: echo each mpirun command")
    return p.parse_args(argv)


def message_sizes(args: argparse.Namespace) -> list[int]:
    """Sizes in bytes, rounded down to whole elements of ``--dtype``."""
    item = np.dtype(args.dtype).itemsize
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    else:
        sizes, s = [], args.min_bytes
        while s <= args.max_bytes:
            sizes.append(s)
            s *= args.step
    return [max(item, s - s % item) for s in sizes]


# ----------------------------------------------------------------------------- worker
def _contender(impl: str, comm, device: str):
    """``allreduce(send, recv)`` (recv = the sum of every rank's send) for ``impl``."""
    from mpi4py import MPI

    if impl == "raw":
        return lambda send, recv: comm.Allreduce(send, recv, op=MPI.SUM)
    if impl == "tdist":
        import torch.distributed as dist

        torch_default_group(comm, device)

        def direct(send, recv):
            recv.copy_(send)
            dist.all_reduce(recv)
        return direct
    import hvps

    if device == "cuda":
        import torch

        torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    hvps.init()
    return lambda send, recv: hvps.allreduce(send, op=hvps.Sum, out=recv)


def _buffers(impl: str, count: int, dtype: str, rank: int, device: str) -> tuple:
    send = np.full(count, rank + 1, dtype=dtype)
    if impl not in TORCH_IMPLS:
        return send, np.zeros_like(send)
    import torch

    tensor = torch.from_numpy(send).to(device)
    return tensor, torch.zeros_like(tensor)


def run_worker(args: argparse.Namespace) -> None:
    """Time ``args.impl`` for every size; rank 0 prints a table and writes JSON."""
    if args.impl in ("hvps-mpi", "hvps-ring"):
        os.environ["HVPS_ALLREDUCE_ALGORITHM"] = args.impl.split("-", 1)[1]
        os.environ["HVPS_BACKEND"] = "mpi"
        os.environ["HVPS_SHM"] = "0"
    elif args.impl == "hvps-shm":
        os.environ["HVPS_BACKEND"] = "mpi"
        os.environ["HVPS_SHM"] = "1"
    elif args.impl == "hvps-sealed":
        os.environ["HVPS_BACKEND"] = "mpi"
        os.environ["HVPS_SHM"] = "0"
        os.environ["HVPS_ENCRYPT"] = "all"
    elif args.impl == "hvps-tdist":
        os.environ["HVPS_BACKEND"] = "tdist"
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    device = args.device if args.impl in TORCH_IMPLS else "cpu"
    allreduce = _contender(args.impl, comm, device)
    if device == "cuda":
        import torch

        call = allreduce

        def allreduce(send, recv) -> None:  # time the device's work, not just its launch
            call(send, recv)
            torch.cuda.synchronize()
    worker_clock = _worker_clock()
    origin = sys.modules["hvps"].__file__ if "hvps" in sys.modules else "-"
    log0(rank, f"# hvps allreduce benchmark: impl={args.impl} ranks={size} dtype={args.dtype} hvps={origin}")
    log0(rank, f"# {'Size':>12} {'Median(us)':>12} {'Avg(us)':>12} {'Min(us)':>12} {'Max(us)':>12} {'busbw(GB/s)':>12}")
    results = []
    for nbytes in message_sizes(args):
        large = nbytes >= args.large_bytes
        iters, warmup = (args.iters_large, args.warmup_large) if large else (args.iters, args.warmup)
        send, recv = _buffers(args.impl, nbytes // np.dtype(args.dtype).itemsize, args.dtype, rank, device)
        for _ in range(max(1, warmup)):
            allreduce(send, recv)
        expected = size * (size + 1) // 2
        ok = bool((recv == expected).all())
        ok = comm.allreduce(ok, op=MPI.LAND)
        times = np.empty(iters)
        thread_cpu = process_cpu = 0.0
        for i in range(iters):
            comm.Barrier()
            c0, p0 = worker_clock(), time.process_time()
            t0 = MPI.Wtime()
            allreduce(send, recv)
            times[i] = MPI.Wtime() - t0
            thread_cpu += worker_clock() - c0
            process_cpu += time.process_time() - p0
        cpu = comm.reduce((thread_cpu, process_cpu), op=lambda a, b: (a[0] + b[0], a[1] + b[1]), root=0)
        slowest = np.empty_like(times) if rank == 0 else None
        comm.Reduce(times, slowest, op=MPI.MAX, root=0)
        if rank == 0:
            t = float(np.median(slowest))
            busbw = nbytes / t * 2 * (size - 1) / size / 1e9
            per_byte = 1e9 / (size * iters * max(1, nbytes))
            results.append({"bytes": nbytes, "iters": iters, "correct": ok,
                            "thread_cpu_ns_per_byte": cpu[0] * per_byte, "process_cpu_ns_per_byte": cpu[1] * per_byte,
                            "median_s": t, "mean_s": float(slowest.mean()),
                            "min_s": float(slowest.min()), "max_s": float(slowest.max())})
            print(f"{nbytes:>14} {t * 1e6:>12.1f} {slowest.mean() * 1e6:>12.1f} {slowest.min() * 1e6:>12.1f} "
                  f"{slowest.max() * 1e6:>12.1f} {busbw:>12.3f}{'' if ok else '  WRONG RESULT'}", flush=True)
        del send, recv
    if rank == 0:
        write_json(args.json, {"impl": args.impl, "hvps": origin, "ranks": size, "dtype": args.dtype, "device": device,
                               "results": results})
    if args.impl.startswith("hvps-"):
        shutdown = getattr(sys.modules["hvps"], "shutdown", None)
        if shutdown is not None:
            shutdown()


def _worker_clock():
    """CPU seconds so far of the threads that may run the collective: this one, plus hvps's engine thread
    (a synchronous call may run on either)."""
    import threading

    engine = next((t for t in threading.enumerate() if t.name == "hvps-engine"), None)
    if engine is None:
        return time.thread_time
    clock = time.pthread_getcpuclockid(engine.ident)
    return lambda: time.clock_gettime(clock) + time.thread_time()


# ----------------------------------------------------------------------------- driver
def worker_argv(args: argparse.Namespace, impl: str) -> list[str]:
    """Command-line arguments for one worker job."""
    sizes = ",".join(str(s) for s in message_sizes(args))
    return ["--impl", impl, "--sizes", sizes, "--dtype", args.dtype,
            "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--iters-large", str(args.iters_large), "--warmup-large", str(args.warmup_large),
            "--large-bytes", str(args.large_bytes), "--device", args.device]


def run_driver(args: argparse.Namespace) -> dict:
    """Alternate implementations over rounds; aggregate medians; print a table."""
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"unknown implementation {impl!r}; choose from {IMPLS}")
    reference = args.reference or ("raw" if "raw" in impls else "tdist")
    sizes = message_sizes(args)
    runs: dict[str, list[dict]] = {impl: [] for impl in impls}
    errors: dict[str, str] = {}
    for rnd in range(args.rounds):
        for impl in impls:
            if impl in errors:
                continue
            print(f"round {rnd + 1}/{args.rounds}: {impl} ...", flush=True)
            try:
                runs[impl].append(run_mpi_worker(args.np, __file__, worker_argv(args, impl),
                                                 mpirun=args.mpirun, mpirun_args=args.mpirun_args,
                                                 timeout=args.timeout, verbose=args.verbose))
            except Exception as exc:  # keep going with the other contenders
                errors[impl] = str(exc)
                print(f"  {impl} failed; skipping it in later rounds:\n{exc}", file=sys.stderr, flush=True)

    bus = 2 * (args.np - 1) / args.np
    table = []
    for i, nbytes in enumerate(sizes):
        row: dict = {"bytes": nbytes, "size": fmt_bytes(nbytes)}
        for impl in impls:
            if not runs[impl]:
                continue
            per_round = [r["results"][i]["median_s"] for r in runs[impl]]
            t = median(per_round)
            fastest = [r["results"][i]["min_s"] for r in runs[impl]]
            row[impl] = {"median_s": t, "per_round_median_s": per_round,
                         "min_s": median(fastest), "per_round_min_s": fastest,
                         "algbw_GBps": nbytes / t / 1e9, "busbw_GBps": nbytes / t * bus / 1e9,
                         "thread_cpu_ns_per_byte": median([r["results"][i]["thread_cpu_ns_per_byte"]
                                                          for r in runs[impl]]),
                         "process_cpu_ns_per_byte": median([r["results"][i]["process_cpu_ns_per_byte"]
                                                           for r in runs[impl]]),
                         "correct": all(r["results"][i]["correct"] for r in runs[impl])}
        if reference in row:
            for impl in impls:
                if impl != reference and impl in row:
                    row[impl][f"time_ratio_vs_{reference}"] = row[impl]["median_s"] / row[reference]["median_s"]
                    row[impl][f"bw_ratio_vs_{reference}"] = row[reference]["median_s"] / row[impl]["median_s"]
        table.append(row)

    present = [impl for impl in impls if runs[impl]]
    head = f"{'size':>10}" + "".join(f" {impl + ' us':>13} {'busbw GB/s':>10}" for impl in present)
    ratios = [impl for impl in present if impl != reference and reference in present]
    head += "".join(f" {impl + '/' + reference + ' t':>18}" for impl in ratios)
    print(f"\n# allreduce, {args.np} ranks, {args.dtype} on {args.device}, medians over {args.rounds} rounds "
          f"(ratio = time / time of {reference}; <= 1 is as fast as {reference})")
    print(head)
    for row in table:
        line = f"{row['size']:>10}"
        for impl in present:
            ok = "" if row[impl]["correct"] else "!"
            line += f" {row[impl]['median_s'] * 1e6:>12.1f}{ok or ' '} {row[impl]['busbw_GBps']:>10.3f}"
        for impl in ratios:
            line += f" {row[impl][f'time_ratio_vs_{reference}']:>18.3f}"
        print(line)
    print("\n# CPU ns per byte (threads running the collective / whole process), medians over rounds")
    for row in table:
        print(f"{row['size']:>10}" + "".join(
            f"  {impl}: {row[impl]['thread_cpu_ns_per_byte']:.3f} / {row[impl]['process_cpu_ns_per_byte']:.3f}"
            for impl in present))
    result = {"benchmark": "allreduce", "ranks": args.np, "dtype": args.dtype, "device": args.device,
              "reference": reference, "rounds": args.rounds,
              "impls": impls, "mpirun_args": args.mpirun_args, "iters": args.iters,
              "iters_large": args.iters_large, "large_bytes": args.large_bytes,
              "hvps_files": {impl: sorted({str(r.get("hvps")) for r in runs[impl]}) for impl in impls},
              "results": table, "errors": errors}
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None) -> None:
    dispatch(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    main()
