"""Latency of synchronous small collectives: hvps against the data plane under it, side by side.

Contenders, each in ``mpirun`` jobs of its own, alternating over ``--rounds`` (A B C A B C ...):

* ``raw``:        mpi4py's blocking collectives (``Allreduce``, ``Bcast``, ``Allgather``, ``Alltoall``)
* ``hvps``:       hvps's synchronous calls (``hvps.allreduce`` ...), the default settings: a waiter
  alone in flight runs the engine itself (the fast path, ``HVPS_SPIN_WAIT_MICROSECONDS``)
* ``hvps-slow``:  the same with ``HVPS_SPIN_WAIT_MICROSECONDS=0``: every call handed to the engine
  thread and back (the path every call took before the fast path)
* ``hvps-no-lane``: the default settings but ``HVPS_FAST_LANE=0``: every call agreed through rank 0 (the fast
  lane off; ``--impls`` must name it)
* ``gloo``:       ``torch.distributed`` with gloo on CPU tensors (``--impls`` must name it; needs torch)
* ``hvps-plane``: the data plane under hvps (the engine's backend: the shared-memory plane on one host) called
  directly, without negotiation: the floor of a call that skipped agreeing with the other ranks
  (``--impls`` must name it)

Per call: the slowest rank's time, calls separated by a barrier (``MPI.Wtime``); per job the median of
``--iters`` calls; reported: the median over rounds and the ratio to ``raw``. Each call of hvps has
its own fixed name, so after the first call the response cache knows it, as in a training loop.

    python benchmarks/latency.py --np 2 --rounds 3 --json out/latency.json
    python benchmarks/latency.py --np 2 --impls raw,hvps,hvps-slow,gloo --ops allreduce --sizes 4,64KiB,1MiB
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    DEFAULT_MPIRUN_ARGS,
    MPIRUN_HELP,
    dispatch,
    fmt_bytes,
    median,
    parse_size,
    run_mpi_worker,
    torch_default_group,
    write_json,
)

IMPLS = ("raw", "hvps", "hvps-slow", "gloo", "hvps-plane", "hvps-no-lane")
OPS = ("allreduce", "broadcast", "allgather", "alltoall")
#: environment of each contender's job
ENV = {"hvps-slow": {"HVPS_SPIN_WAIT_MICROSECONDS": "0"}, "hvps-no-lane": {"HVPS_FAST_LANE": "0"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="worker mode: time this contender (run under mpirun)")
    p.add_argument("--impls", default="raw,hvps,hvps-slow",
                   help=f"driver: comma-separated contenders from {', '.join(IMPLS)} (default: %(default)s)")
    p.add_argument("--ops", default=",".join(OPS), help=f"collectives to time, from {', '.join(OPS)} "
                   "(default: all)")
    p.add_argument("--sizes", default="4,64KiB,1MiB",
                   help="bytes per rank, comma-separated (default: %(default)s; 1 MiB for allreduce only)")
    p.add_argument("--np", type=int, default=2, help="driver: ranks per job (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="driver: rounds of alternating jobs (default: %(default)s)")
    p.add_argument("--iters", type=int, default=200, help="timed calls per collective and size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first (default: %(default)s)")
    p.add_argument("--mpirun", default=None, help="driver: " + MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS, help="driver: extra mpirun flags (default: "
                   "'%(default)s')")
    p.add_argument("--timeout", type=float, default=600, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="write the results as JSON to this path (driver; rank 0 of a worker)")
    p.add_argument("--verbose", action="store_true", help="driver: echo each mpirun command")
    return p.parse_args(argv)


def cases(args: argparse.Namespace) -> list:
    """``(op, bytes)`` pairs: every op at every size, 1 MiB and more for allreduce only."""
    sizes = [max(4, parse_size(s) // 4 * 4) for s in args.sizes.split(",") if s.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    return [(op, n) for op in ops for n in sizes if op == "allreduce" or n < (1 << 20)]


# ----------------------------------------------------------------------------- worker
def _raw(comm, op: str):
    from mpi4py import MPI

    calls = {"allreduce": lambda a, out: comm.Allreduce(a, out, op=MPI.SUM),
             "broadcast": lambda a, out: comm.Bcast(a, root=0),
             "allgather": lambda a, out: comm.Allgather(a, out),
             "alltoall": lambda a, out: comm.Alltoall(a, out)}
    return calls[op]


def _hvps(op: str, name: str):
    import hvps

    calls = {"allreduce": lambda a, out: hvps.allreduce(a, op=hvps.Sum, name=name, out=out),
             "broadcast": lambda a, out: hvps.broadcast(a, 0, name=name, out=a),
             "allgather": lambda a, out: hvps.allgather(a, name=name),
             "alltoall": lambda a, out: hvps.alltoall(a, name=name)}
    return calls[op]


def _plane(op: str, size: int):
    import hvps
    from hvps.runtime import state

    backend = state.engine().backend

    def alltoall(a, out):
        counts = [len(a) // size] * size
        backend.alltoallv(a, counts, out, counts)

    calls = {"allreduce": lambda a, out: backend.allreduce(a, out, hvps.Sum),
             "broadcast": lambda a, out: backend.broadcast(a, 0),
             "allgather": lambda a, out: backend.allgatherv(a, out, [len(a)] * size),
             "alltoall": alltoall}
    return calls[op]


def _gloo(op: str):
    import torch
    import torch.distributed as dist

    def gather(a, out):
        dist.all_gather_into_tensor(out, a)

    calls = {"allreduce": lambda a, out: dist.all_reduce(a),
             "broadcast": lambda a, out: dist.broadcast(a, 0),
             "allgather": gather,
             "alltoall": lambda a, out: dist.all_to_all_single(out, a)}
    return calls[op], torch.from_numpy


def run_worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.impl.startswith("hvps"):
        import hvps

        hvps.init()
    elif args.impl == "gloo":
        torch_default_group(comm)
    rng = np.random.default_rng(rank)
    results = []
    for op, nbytes in cases(args):
        count = nbytes // 4
        send = rng.random(max(count, size) if op == "alltoall" else count, dtype=np.float32)
        if op == "alltoall":
            send = send[: len(send) - len(send) % size]
        out = np.empty(len(send) * (size if op == "allgather" else 1), np.float32)
        convert = None
        if args.impl == "raw":
            call = _raw(comm, op)
        elif args.impl == "gloo":
            call, convert = _gloo(op)
        elif args.impl == "hvps-plane":
            call = _plane(op, size)
        else:
            call = _hvps(op, f"latency.{op}.{nbytes}")
        a, o = (convert(send), convert(out)) if convert else (send, out)
        for _ in range(args.warmup):
            call(a, o)
        times = np.empty(args.iters)
        for i in range(args.iters):
            comm.Barrier()
            start = MPI.Wtime()
            call(a, o)
            times[i] = MPI.Wtime() - start
        slowest = np.empty_like(times) if rank == 0 else None
        comm.Reduce(times, slowest, op=MPI.MAX, root=0)
        if rank == 0:
            results.append({"op": op, "bytes": nbytes, "median_s": float(np.median(slowest))})
    if rank == 0:
        write_json(args.json, {"impl": args.impl, "ranks": size, "results": results})
    if args.impl.startswith("hvps"):
        import hvps

        hvps.shutdown()


# ----------------------------------------------------------------------------- driver
def run_driver(args: argparse.Namespace) -> dict:
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    for impl in impls:
        if impl not in IMPLS:
            raise SystemExit(f"unknown contender {impl!r}: choose from {', '.join(IMPLS)} (--impls)")
    worker = ["--ops", args.ops, "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    runs: dict = {impl: [] for impl in impls}
    for round_ in range(args.rounds):
        for impl in impls:
            print(f"round {round_ + 1}/{args.rounds}: {impl}", file=sys.stderr, flush=True)
            env = ENV.get(impl, {})
            runs[impl].append(run_mpi_worker(args.np, __file__, ["--impl", impl, *worker], env, args.mpirun,
                                             args.mpirun_args, args.timeout, args.verbose))
    table = []
    for op, nbytes in cases(args):
        row = {"op": op, "bytes": nbytes}
        for impl in impls:
            row[impl] = median([next(r["median_s"] for r in run["results"] if (r["op"], r["bytes"]) == (op, nbytes))
                                for run in runs[impl]])
        table.append(row)
    header = "| op | size | " + " | ".join(f"{i} µs" for i in impls)
    header += "".join(f" | {i} / raw" for i in impls if i != "raw" and "raw" in impls) + " |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for row in table:
        cells = [row["op"], fmt_bytes(row["bytes"])] + [f"{row[i] * 1e6:,.1f}" for i in impls]
        if "raw" in impls:
            cells += [f"{row[i] / row['raw']:.1f}" for i in impls if i != "raw"]
        print("| " + " | ".join(cells) + " |")
    result = {"ranks": args.np, "rounds": args.rounds, "iters": args.iters, "table": table, "runs": runs}
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None) -> None:
    dispatch(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    main()
