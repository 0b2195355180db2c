"""Stage 1-2 step time side by side (issue 39, "Speed"): sharded vs replicated hvps, and torch's ZeRO + DDP.

Each contender trains the transformer block stack of ``benchmarks/fully_sharded.py`` (or, with ``--model
resnet50``, ``benchmarks/resnet.py``'s ResNet-50 on ``--image``-pixel images) with Adam (``foreach=False``) in its own ``mpirun`` job of ``--np`` ranks; the driver runs every contender once per round,
in the same order each round (A B C A B C ...), so a load that comes and goes falls on all of them alike, and
records the load average before each job. Contenders:

* ``replicated``: ``hvd.DistributedOptimizer`` (every rank steps the whole model);
* ``sharded``: ``hvd.DistributedOptimizer(..., shard=True)`` (ZeRO stage 2: reduce-scatter, a shard's step,
  all-gather);
* ``baseline``: ``sharded`` with hvps imported from ``--baseline-tree`` (another checkout, e.g. ``git archive
  main``), for before/after;
* ``zero``: ``torch.distributed.optim.ZeroRedundancyOptimizer`` (stage 1) under ``DistributedDataParallel``, gloo.

In a job each timed step starts after a barrier and counts the slowest rank's time; the job reports the median of
its ``--steps`` timed steps (after one untimed). The summary gives each contender's median over the rounds and
``replicated / contender`` (above 1: faster than replicated). JSON on stdout.

    python benchmarks/sharded_step.py --np 2 --rounds 3 --contenders replicated,sharded,baseline,zero \\
        --baseline-tree /tmp/hvps-main
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from sharded_memory_cap import add_model_arguments, parse_contender_arguments  # noqa: E402
CONTENDERS = ("replicated", "sharded", "baseline", "zero")


def worker(args) -> None:
    """One rank of one contender's job: time ``args.steps`` steps; rank 0 prints ``RESULT {json}``."""
    import torch
    from fully_sharded import BlockStack, step

    torch.set_num_threads(1)
    if args.contender == "zero":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                                world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
        rank = dist.get_rank()
        barrier = dist.barrier

        def slowest(seconds: float) -> float:
            t = torch.tensor([seconds])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t)
    else:
        import hvps.adapters.torch as hvd

        hvd.init()
        rank, barrier = hvd.rank(), hvd.barrier

        def slowest(seconds: float) -> float:
            return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max))
    torch.manual_seed(0)
    if args.model == "resnet50":
        from resnet import resnet50

        model = resnet50()
        shape: tuple = (args.batch, 3, args.image, args.image)
    else:
        model = BlockStack(args.width, args.depth, args.heads)
        shape = (args.batch, args.seq, args.width)
    if args.contender == "zero":
        model = DistributedDataParallel(model)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, foreach=False)
    else:
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), foreach=False),
                                             named_parameters=model.named_parameters(),
                                             shard=args.contender in ("sharded", "baseline"))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1 + rank))
    times = []
    for _ in range(args.steps + 1):
        barrier()
        start = time.perf_counter()
        step(model, optimizer, x)
        times.append(slowest(time.perf_counter() - start))
    if rank == 0:
        print("RESULT " + json.dumps({"step_s": statistics.median(times[1:]), "steps_s": times[1:]}), flush=True)


def run_job(args, contender: str) -> dict:
    """One ``mpirun`` job of ``contender``; what its rank 0 reported, with the load average before it."""
    from hvps.runner.mpi_discovery import find_mpirun

    tree = args.baseline_tree if contender == "baseline" else str(HERE.parent)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
    if contender == "zero":
        with socket.socket() as s:  # a free port for torch.distributed's rendezvous
            s.bind(("127.0.0.1", 0))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    argv = [find_mpirun().path, "-np", str(args.np), "--oversubscribe", sys.executable, __file__, "--worker",
            "--contender", contender, "--model", args.model, "--image", str(args.image), "--width", str(args.width), "--depth", str(args.depth), "--heads",
            str(args.heads), "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    load = os.getloadavg()[0]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines() if "RESULT {" in line]
    if done.returncode != 0 or not results:
        raise RuntimeError(f"{contender}: {shlex.join(argv)} failed ({done.returncode}):\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return {"contender": contender, "load_before": round(load, 2), **results[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks")
    p.add_argument("--contenders", default="replicated,sharded,zero", help="comma-separated, from "
                   + ", ".join(CONTENDERS))
    p.add_argument("--baseline-tree", default="", help="the checkout the baseline contender imports hvps from")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per job (after one untimed)")
    p.add_argument("--model", choices=("blocks", "resnet50"), default="blocks")
    p.add_argument("--image", type=int, default=64, help="resnet50: image side in pixels")
    add_model_arguments(p)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job")
    args = parse_contender_arguments(p, CONTENDERS)
    if args.worker:
        worker(args)
        return
    contenders = args.contenders.split(",")
    if "baseline" in contenders and not args.baseline_tree:
        p.error("the baseline contender needs --baseline-tree")
    sys.path.insert(0, str(HERE.parent))
    rounds = []
    for r in range(args.rounds):
        rounds.append([run_job(args, c) for c in contenders])
        print(json.dumps({"round": r, "jobs": rounds[-1]}), file=sys.stderr, flush=True)
    medians = {c: statistics.median(job["step_s"] for jobs in rounds for job in jobs if job["contender"] == c)
               for c in contenders}
    summary = {"np": args.np, "model": args.model, "width": args.width, "depth": args.depth, "rounds": rounds,
               "median_step_s": {c: round(m, 4) for c, m in medians.items()}}
    if "replicated" in medians:
        summary["replicated_over"] = {c: round(medians["replicated"] / m, 3) for c, m in medians.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
