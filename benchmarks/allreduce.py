"""OSU-style allreduce sweep: raw mpi4py ``Allreduce`` vs hvps ``allreduce``.

Driver mode (default, run without mpirun)::

    python benchmarks/allreduce.py --np 2 --json out/allreduce.json
    python benchmarks/allreduce.py --np 2 --sizes 64MiB --rounds 5

launches, for each of ``--rounds`` rounds, one ``mpirun -np N`` job per
implementation (A B C A B C ...), so every contender is timed in processes of
its own: a busy background thread of one implementation can never slow the
reference. Reports medians over rounds of each job's median per-call time
(per call: the slowest rank's time, calls separated by a barrier, ``MPI.Wtime``),
algbw = bytes/time, busbw = algbw * 2(n-1)/n and hvps/raw ratios.

Worker mode (``--impl raw|hvps-mpi|hvps-ring``, under mpirun) times one
implementation and prints an OSU-style table from rank 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (DEFAULT_MPIRUN_ARGS, MiB, fmt_bytes, log0, median,  # noqa: E402
                               parse_size, run_mpi_worker, write_json)

IMPLS = ("raw", "hvps-mpi", "hvps-ring")
DTYPES = ("float32", "float64", "int32", "int64")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="worker mode: time this implementation (run under mpirun)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="driver: comma-separated implementations to compare (default: %(default)s)")
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
    p.add_argument("--mpirun", default="mpirun", help="driver: mpirun executable (default: %(default)s)")
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
def run_worker(args: argparse.Namespace) -> None:
    """Time ``args.impl`` for every size; rank 0 prints a table and writes JSON."""
    if args.impl.startswith("hvps-"):
        os.environ["HVPS_ALLREDUCE_ALGORITHM"] = args.impl.split("-", 1)[1]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.impl == "raw":
        def allreduce(send: np.ndarray, recv: np.ndarray) -> None:
            comm.Allreduce(send, recv, op=MPI.SUM)
    else:
        import hvps
        hvps.init()

        def allreduce(send: np.ndarray, recv: np.ndarray) -> None:
            hvps.allreduce(send, op=hvps.Sum, out=recv)

    log0(rank, f"# hvps allreduce benchmark: impl={args.impl} ranks={size} dtype={args.dtype}")
    log0(rank, f"# {'Size':>12} {'Median(us)':>12} {'Avg(us)':>12} {'Min(us)':>12} {'Max(us)':>12} {'busbw(GB/s)':>12}")
    results = []
    for nbytes in message_sizes(args):
        large = nbytes >= args.large_bytes
        iters, warmup = (args.iters_large, args.warmup_large) if large else (args.iters, args.warmup)
        send = np.full(nbytes // np.dtype(args.dtype).itemsize, rank + 1, dtype=args.dtype)
        recv = np.zeros_like(send)
        for _ in range(max(1, warmup)):
            allreduce(send, recv)
        expected = size * (size + 1) // 2
        ok = bool(np.all(recv == expected))
        ok = comm.allreduce(ok, op=MPI.LAND)
        times = np.empty(iters)
        for i in range(iters):
            comm.Barrier()
            t0 = MPI.Wtime()
            allreduce(send, recv)
            times[i] = MPI.Wtime() - t0
        slowest = np.empty_like(times) if rank == 0 else None
        comm.Reduce(times, slowest, op=MPI.MAX, root=0)
        if rank == 0:
            t = float(np.median(slowest))
            busbw = nbytes / t * 2 * (size - 1) / size / 1e9
            results.append({"bytes": nbytes, "iters": iters, "correct": ok,
                            "median_s": t, "mean_s": float(slowest.mean()),
                            "min_s": float(slowest.min()), "max_s": float(slowest.max())})
            print(f"{nbytes:>14} {t * 1e6:>12.1f} {slowest.mean() * 1e6:>12.1f} {slowest.min() * 1e6:>12.1f} "
                  f"{slowest.max() * 1e6:>12.1f} {busbw:>12.3f}{'' if ok else '  WRONG RESULT'}", flush=True)
        del send, recv
    if rank == 0:
        write_json(args.json, {"impl": args.impl, "ranks": size, "dtype": args.dtype, "results": results})
    if args.impl != "raw":
        shutdown = getattr(sys.modules["hvps"], "shutdown", None)
        if shutdown is not None:
            shutdown()


# ----------------------------------------------------------------------------- driver
def worker_argv(args: argparse.Namespace, impl: str) -> list[str]:
    """Command-line arguments for one worker job."""
    sizes = ",".join(str(s) for s in message_sizes(args))
    return ["--impl", impl, "--sizes", sizes, "--dtype", args.dtype,
            "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--iters-large", str(args.iters_large), "--warmup-large", str(args.warmup_large),
            "--large-bytes", str(args.large_bytes)]


def run_driver(args: argparse.Namespace) -> dict:
    """Alternate implementations over rounds; aggregate medians; print a table."""
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"unknown implementation {impl!r}; choose from {IMPLS}")
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
            row[impl] = {"median_s": t, "per_round_median_s": per_round,
                         "algbw_GBps": nbytes / t / 1e9, "busbw_GBps": nbytes / t * bus / 1e9,
                         "correct": all(r["results"][i]["correct"] for r in runs[impl])}
        if "raw" in row:
            for impl in impls:
                if impl != "raw" and impl in row:
                    row[impl]["time_ratio_vs_raw"] = row[impl]["median_s"] / row["raw"]["median_s"]
                    row[impl]["bw_ratio_vs_raw"] = row["raw"]["median_s"] / row[impl]["median_s"]
        table.append(row)

    present = [impl for impl in impls if runs[impl]]
    head = f"{'size':>10}" + "".join(f" {impl + ' us':>13} {'busbw GB/s':>10}" for impl in present)
    head += "".join(f" {impl + '/raw t':>15}" for impl in present if impl != "raw" and "raw" in present)
    print(f"\n# allreduce, {args.np} ranks, {args.dtype}, medians over {args.rounds} rounds "
          f"(ratio = time hvps / time raw; <= 1 is as fast as raw)")
    print(head)
    for row in table:
        line = f"{row['size']:>10}"
        for impl in present:
            ok = "" if row[impl]["correct"] else "!"
            line += f" {row[impl]['median_s'] * 1e6:>12.1f}{ok or ' '} {row[impl]['busbw_GBps']:>10.3f}"
        for impl in present:
            if impl != "raw" and "raw" in present:
                line += f" {row[impl]['time_ratio_vs_raw']:>15.3f}"
        print(line)
    result = {"benchmark": "allreduce", "ranks": args.np, "dtype": args.dtype, "rounds": args.rounds,
              "impls": impls, "mpirun_args": args.mpirun_args, "iters": args.iters,
              "iters_large": args.iters_large, "large_bytes": args.large_bytes,
              "results": table, "errors": errors}
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.impl:
        run_worker(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
