"""Allreduce in a job started without MPI (``hvpsrun --gloo``): hvps against torch.distributed.

Issue 24's target: hvps's allreduce of 64 MiB float32 on CPU takes at most 1/0.95 of the time of
``torch.distributed.all_reduce`` on a gloo group, both in jobs that ``hvpsrun --gloo`` started
(no MPI anywhere). Contenders, each in jobs of its own, alternating (A B A B ...) for ``--rounds``:

- ``tdist``: ``dist.all_reduce`` on a default gloo group that meets in hvpsrun's rendezvous store;
- ``hvps``: ``hvps.allreduce(send, op=Sum, out=recv)`` on the same torch tensors (data plane
  torch.distributed, chosen by hvps because there is no MPI).

Per call: the slowest rank's time (calls separated by a barrier); a job reports its median; the
driver reports the median over rounds and the ratio hvps/tdist (time; <= 1/0.95 = 1.053 meets it)::

    python benchmarks/gloo_allreduce.py --np 2 --sizes 1MiB,64MiB --rounds 5 --json out/gloo.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import MiB, dispatch, fmt_bytes, log0, median, parse_size, write_json  # noqa: E402

IMPLS = ("tdist", "hvps")
TARGET = 0.95  # hvps throughput / torch.distributed's, at 64 MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=IMPLS, help="worker mode: time this contender (run under hvpsrun --gloo)")
    p.add_argument("--np", type=int, default=2, help="driver: workers per job (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="driver: rounds of alternating jobs (default: %(default)s)")
    p.add_argument("--sizes", default="1MiB,64MiB", help="comma-separated message sizes (default: %(default)s)")
    p.add_argument("--iters", type=int, default=15, help="timed calls per size (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls per size (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="driver: write the results as JSON to this path")
    return p.parse_args(argv)


def _sizes(args: argparse.Namespace) -> list[int]:
    return [parse_size(s) // 4 * 4 for s in args.sizes.split(",") if s.strip()]


# ----------------------------------------------------------------------------- worker
def _contender(impl: str):
    """``(allreduce(send, recv), barrier(), slowest(times) -> times, rank, size)`` for ``impl``."""
    import torch
    import torch.distributed as dist

    if impl == "tdist":
        rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
        address = os.environ["HVPS_RENDEZVOUS_ADDR"].split(",")[0]
        store = dist.TCPStore(address, int(os.environ["HVPS_RENDEZVOUS_PORT"]), None, False,
                              datetime.timedelta(seconds=60), wait_for_workers=False)
        dist.init_process_group("gloo", store=dist.PrefixStore("benchmark", store), rank=rank, world_size=size)

        def direct(send, recv):
            recv.copy_(send)
            dist.all_reduce(recv)

        def slowest(times):
            t = torch.from_numpy(times.copy())
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.numpy()
        return direct, dist.barrier, slowest, rank, size
    import hvps

    hvps.init()
    return (lambda send, recv: hvps.allreduce(send, op=hvps.Sum, out=recv, name="bench"), hvps.barrier,
            lambda times: hvps.allreduce(times, op=hvps.Max, name="times"), hvps.rank(), hvps.size())


def run_worker(args: argparse.Namespace) -> None:
    import torch

    allreduce, barrier, slowest, rank, size = _contender(args.impl)
    results = {}
    for nbytes in _sizes(args):
        send = torch.from_numpy(np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32))
        recv = torch.zeros_like(send)
        for _ in range(max(1, args.warmup)):
            allreduce(send, recv)
        times = np.empty(args.iters)
        for i in range(args.iters):
            barrier()
            start = time.perf_counter()
            allreduce(send, recv)
            times[i] = time.perf_counter() - start
        results[nbytes] = float(np.median(slowest(times)))
    log0(rank, "RESULT " + json.dumps({"impl": args.impl, "size": size, "seconds": results}))


# ----------------------------------------------------------------------------- driver
def _job(args: argparse.Namespace, impl: str) -> dict:
    cmd = [sys.executable, "-m", "hvps.runner.launch", "--gloo", "-np", str(args.np), sys.executable, __file__,
           "--impl", impl, "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False)
    found = [line.split("RESULT ", 1)[1] for line in run.stdout.splitlines() if "RESULT " in line]
    if run.returncode != 0 or not found:
        raise SystemExit(f"the {impl} job failed (exit {run.returncode}):\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
    return {int(k): v for k, v in json.loads(found[0])["seconds"].items()}


def run_driver(args: argparse.Namespace) -> None:
    rounds = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
        for impl in IMPLS:
            rounds[impl].append(_job(args, impl))
        print(f"# round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    rows = []
    for nbytes in _sizes(args):
        tdist = median([job[nbytes] for job in rounds["tdist"]])
        hvps = median([job[nbytes] for job in rounds["hvps"]])
        rows.append({"bytes": nbytes, "tdist_s": tdist, "hvps_s": hvps, "throughput_ratio": tdist / hvps,
                     "per_round_tdist_ms": [round(job[nbytes] * 1e3, 2) for job in rounds["tdist"]],
                     "per_round_hvps_ms": [round(job[nbytes] * 1e3, 2) for job in rounds["hvps"]]})
    print(f"{'size':>8} {'tdist ms':>10} {'hvps ms':>10} {'hvps/tdist throughput':>22}")
    for row in rows:
        print(f"{fmt_bytes(row['bytes']):>8} {row['tdist_s'] * 1e3:10.2f} {row['hvps_s'] * 1e3:10.2f} "
              f"{row['throughput_ratio']:22.3f}")
    at_64 = [row for row in rows if row["bytes"] == 64 * MiB]
    verdict = {"target": f">= {TARGET} at 64 MiB", "met": bool(at_64 and at_64[0]["throughput_ratio"] >= TARGET)}
    print(json.dumps(verdict))
    write_json(args.json, {"np": args.np, "rounds": args.rounds, "rows": rows, "verdict": verdict})


if __name__ == "__main__":
    dispatch(None, parse_args, run_worker, run_driver)
