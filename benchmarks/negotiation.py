"""Negotiation cost per training step, with and without the response cache.

Each step submits ResNet-50's 161 gradients, by their real names and in backward order, as
``allreduce_async`` of tiny arrays (8 float32 each), then waits for all of them: the data
plane moves a few KiB, so the step is almost all negotiation (announce, match, fuse,
respond). Two measures per step:

* ``coordinator_s``: the time rank 0's engine thread spent negotiating (matching announcements,
  encoding and sending responses; ``Engine.negotiation_seconds``), and ``worker_s`` the same on
  the busiest other rank (announcing, decoding);
* ``step_s - raw_s``: the whole step's wall time minus one raw ``MPI.Allreduce`` of the same
  bytes, timed side by side in the same job (this also counts the per-tensor submit path);
* ``coordinator_cpu_s`` and ``worker_cpu_s``: the CPU time of rank 0's engine thread per step, and of
  the busiest other rank's (a relay's, in a tree): unlike the wall times, preemption on an
  oversubscribed machine does not count.

Contenders alternate over rounds, each in jobs of its own:

* ``cache``:    the response cache on (``HVPS_CACHE_CAPACITY`` default)
* ``no-cache``: ``HVPS_CACHE_CAPACITY=0`` (every step announces full requests)
* ``before``:   with ``--before DIR``, this script run from another checkout of hvps (e.g. a
  ``git worktree`` of an older commit whose engine counts ``negotiation_seconds``)
* ``fanout-K``: with ``--fanout K``, the cache on and ``HVPS_CONTROL_FANOUT=K`` (a control-plane tree
  with K children per rank, where the default, 16, makes a star up to 17 ranks)

    python benchmarks/negotiation.py --np 2 3 8 --rounds 3 --json out/negotiation.json
    python benchmarks/negotiation.py --np 16 64 --fanout 4 8 --contenders cache --rounds 1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import (  # noqa: E402
    DEFAULT_MPIRUN_ARGS,
    MPIRUN_HELP,
    median,
    run_mpi_worker,
    summarize,
    write_json,
)

CONTENDERS = {"cache": {}, "no-cache": {"HVPS_CACHE_CAPACITY": "0"}}
ELEMENTS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help="worker mode: time steps (run under mpirun)")
    p.add_argument("--np", type=int, nargs="+", default=[2, 3, 8],
                   help="driver: rank counts, one set of jobs each (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="driver: rounds of alternating jobs; medians over rounds (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per job (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per job (default: %(default)s)")
    p.add_argument("--fanout", type=int, nargs="*", default=[],
                   help="driver: also time control-plane trees of these fan-outs (HVPS_CONTROL_FANOUT)")
    p.add_argument("--contenders", nargs="+", choices=sorted(CONTENDERS), default=sorted(CONTENDERS),
                   help="driver: which of the built-in contenders to time (default: all)")
    p.add_argument("--before", default=None, metavar="DIR",
                   help="driver: also time a checkout of hvps in DIR (its own benchmarks/negotiation.py)")
    p.add_argument("--mpirun", default=None, help="driver: " + MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS,
                   help="driver: extra mpirun flags (default: '%(default)s')")
    p.add_argument("--timeout", type=float, default=900, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="write results as JSON to this path (rank 0 / driver)")
    p.add_argument("--verbose", action="store_true", help="driver: echo each mpirun command")
    return p.parse_args(argv)


def _gradient_names() -> list[str]:
    """ResNet-50's parameter names in the order backward produces their gradients."""
    from benchmarks.resnet import resnet50

    return [f"allreduce.{name}" for name, _ in reversed(list(resnet50().named_parameters()))]


def run_worker(args: argparse.Namespace) -> None:
    """Time ``args.steps`` steps; rank 0 writes ``{"hvps_s", "raw_s", ...}`` JSON."""
    from mpi4py import MPI

    import hvps
    from hvps.runtime import state as runtime

    hvps.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    names = _gradient_names()
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(ELEMENTS).astype(np.float32) for _ in names]
    flat = np.concatenate(grads)
    flat_out = np.empty_like(flat)
    expected = comm.allreduce(flat)  # the numpy reference: every rank's arrays summed

    def hvps_step() -> float:
        t0 = time.perf_counter()
        handles = [hvps.allreduce_async(g, op=hvps.Sum, name=n) for g, n in zip(grads, names)]
        outs = [h.wait() for h in handles]
        elapsed = time.perf_counter() - t0
        hvps_step.last = outs
        return elapsed

    def raw_step() -> float:
        t0 = time.perf_counter()
        comm.Allreduce(flat, flat_out, op=MPI.SUM)
        return time.perf_counter() - t0

    times = {"hvps": np.empty(args.steps), "raw": np.empty(args.steps)}
    engine = runtime.engine()
    engine_clock = time.pthread_getcpuclockid(engine._thread.ident)
    engine.count_cpu = True
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            negotiated_before = engine.negotiation_seconds
            negotiated_cpu_before = engine.negotiation_cpu_seconds
            cpu_before = time.clock_gettime(engine_clock)
        for label, step in (("hvps", hvps_step), ("raw", raw_step)):
            comm.Barrier()
            elapsed = step()
            if i >= args.warmup:
                times[label][i - args.warmup] = elapsed
    negotiated = comm.gather((engine.negotiation_seconds - negotiated_before) / args.steps)
    cpu = comm.gather((time.clock_gettime(engine_clock) - cpu_before) / args.steps)
    negotiated_cpu = comm.gather((engine.negotiation_cpu_seconds - negotiated_cpu_before) / args.steps)
    correct = bool(np.allclose(np.concatenate(hvps_step.last), expected, rtol=1e-5, atol=1e-5))
    correct = comm.allreduce(correct, op=MPI.LAND)
    slowest = {}
    for label, t in times.items():
        out = np.empty_like(t) if rank == 0 else None
        comm.Reduce(t, out, op=MPI.MAX, root=0)
        slowest[label] = out
    hvps.shutdown()
    if rank == 0:
        result = {"ranks": size, "tensors": len(names), "correct": correct,
                  "hvps_s": summarize(slowest["hvps"])["median"], "raw_s": summarize(slowest["raw"])["median"],
                  "coordinator_s": negotiated[0], "worker_s": max(negotiated[1:]),
                  "coordinator_cpu_s": cpu[0], "worker_cpu_s": max(cpu[1:]),
                  "coordinator_negotiation_cpu_s": negotiated_cpu[0],
                  "worker_negotiation_cpu_s": max(negotiated_cpu[1:])}
        result["negotiation_s"] = result["hvps_s"] - result["raw_s"]
        write_json(args.json, result)


def run_driver(args: argparse.Namespace) -> dict:
    """Alternate the contenders per rank count; report negotiation per step, medians over rounds."""
    common = ["--worker", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    contenders = {name: (__file__, env) for name, env in CONTENDERS.items() if name in args.contenders}
    contenders.update({f"fanout-{k}": (__file__, {"HVPS_CONTROL_FANOUT": str(k)}) for k in args.fanout})
    if args.before:
        before = Path(args.before).resolve()
        contenders["before"] = (before / "benchmarks" / "negotiation.py", {"PYTHONPATH": str(before)})
    table: dict = {}
    correct = True
    for np_ in args.np:
        runs: dict[str, list] = {c: [] for c in contenders}
        for rnd in range(args.rounds):
            for contender, (script, env) in contenders.items():
                print(f"{np_} ranks, round {rnd + 1}/{args.rounds}: {contender} ...", flush=True)
                res = run_mpi_worker(np_, script, common, env=env, mpirun=args.mpirun,
                                     mpirun_args=args.mpirun_args, timeout=args.timeout, verbose=args.verbose)
                runs[contender].append(res)
                correct = correct and res["correct"]
        row = {c: {"coordinator_s": median([r["coordinator_s"] for r in rs]),
                   "worker_s": median([r["worker_s"] for r in rs]),
                   **{key: median([r.get(key, float("nan")) for r in rs])
                      for key in ("coordinator_cpu_s", "worker_cpu_s", "coordinator_negotiation_cpu_s",
                                  "worker_negotiation_cpu_s")},
                   "negotiation_s": median([r["negotiation_s"] for r in rs]),
                   "hvps_step_s": median([r["hvps_s"] for r in rs]),
                   "raw_allreduce_s": median([r["raw_s"] for r in rs]),
                   "per_round_negotiation_s": [r["negotiation_s"] for r in rs]} for c, rs in runs.items()}
        if "cache" in row and "no-cache" in row:
            row["cached_share"] = row["cache"]["coordinator_s"] / row["no-cache"]["coordinator_s"]
            row["cached_share_of_step"] = row["cache"]["negotiation_s"] / row["no-cache"]["negotiation_s"]
        if "before" in row:
            row["cached_share_of_before"] = row["cache"]["coordinator_s"] / row["before"]["coordinator_s"]
            row["cached_share_of_before_step"] = row["cache"]["negotiation_s"] / row["before"]["negotiation_s"]
        table[str(np_)] = row
    result = {"benchmark": "negotiation", "tensors": 161, "elements_per_tensor": ELEMENTS,
              "rounds": args.rounds, "steps": args.steps, "correct": correct, "by_ranks": table,
              "target": "coordinator cache/no-cache <= 0.20 at 8 ranks"}
    print(f"\n# negotiation per step, 161 tensors, ms (medians over {args.rounds} rounds)")
    print("(negotiation: wall time, CPU time; thread: the engine thread's whole CPU time, the data plane's too)")
    print(f"{'ranks':>5} {'contender':>10} | {'rank 0 negotiation':>18} {'thread':>7} | {'busiest other':>13} "
          f"{'thread':>7} | {'step - raw':>10}")
    for np_, row in table.items():
        for name in contenders:
            ms = {key: value * 1e3 for key, value in row[name].items() if isinstance(value, float)}
            print(f"{np_:>5} {name:>10} | {ms['coordinator_s']:9.2f} {ms['coordinator_negotiation_cpu_s']:8.2f} "
                  f"{ms['coordinator_cpu_s']:7.2f} | {ms['worker_s']:6.2f} {ms['worker_negotiation_cpu_s']:6.2f} "
                  f"{ms['worker_cpu_s']:7.2f} | {ms['negotiation_s']:10.2f}")
    for np_, row in table.items():
        if "before" in row:
            before = row["before"]
            print(f"{np_:>5} | before: rank 0 engine {before['coordinator_s'] * 1e3:.2f} ms, step-raw "
                  f"{before['negotiation_s'] * 1e3:.2f} ms; cache on / before: {row['cached_share_of_before']:.3f} "
                  f"(rank 0 engine), {row['cached_share_of_before_step']:.3f} (step-raw)")
    if not correct:
        print("WRONG RESULT")
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
