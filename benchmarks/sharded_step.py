"""Stage 1-2 step time side by side (issue 39, "Speed"): sharded vs replicated hvps, and torch's ZeRO + DDP.

One ``mpirun`` job holds every contender, each on its own copy of the model, and runs them in turns: round after
round, ``--steps`` steps of each in the same order (A B C A B C ...), so that the load of a shared machine, which
comes and goes, falls on all of them alike. Every contender trains the transformer block stack of
``benchmarks/fully_sharded.py`` (or, with ``--model resnet50``, ``benchmarks/resnet.py``'s ResNet-50 on
``--image``-pixel images) with Adam (``foreach=False``). Contenders:

* ``replicated``: ``hvd.DistributedOptimizer`` (every rank steps the whole model);
* ``sharded``: ``hvd.DistributedOptimizer(..., shard=True)`` (ZeRO stage 2: reduce-scatter, a shard's step,
  all-gather);
* ``baseline``: the same with the ``ShardedOptimizer`` of another file, ``--baseline-file`` (say, the tree before a
  change: ``git show main:hvps/adapters/torch/sharded_optimizer.py > /tmp/before.py``), loaded in place of
  ``hvps.adapters.torch.sharded_optimizer`` (its relative imports are this tree's);
* ``zero``: ``torch.distributed.optim.ZeroRedundancyOptimizer`` (stage 1) under ``DistributedDataParallel`` on
  gloo (rendezvous at ``MASTER_ADDR``/``MASTER_PORT``, which the driver sets).

Each timed step starts after a barrier and counts the slowest rank's time. The result: per round and contender
the median step, the load average at the round's start, and over all rounds each contender's median of round
medians and ``replicated / contender`` (above 1: faster than replicated), as the ratio of those medians and as the
median of each round's ratio (a round's contenders ran under the same load). JSON on stdout.

    python benchmarks/sharded_step.py --np 2 --rounds 5 --steps 3 --width 512 --depth 8 \\
        --contenders replicated,sharded,baseline,zero --baseline-file /tmp/before.py
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from sharded_memory_cap import add_model_arguments, parse_contender_arguments  # noqa: E402

CONTENDERS = ("replicated", "sharded", "baseline", "zero")


def _baseline_class(path: str) -> type:
    """``ShardedOptimizer`` of the file at ``path``, loaded as a module of ``hvps.adapters.torch``."""
    spec = importlib.util.spec_from_file_location("hvps.adapters.torch._baseline_sharded_optimizer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.ShardedOptimizer


def worker(args) -> None:
    """One rank: build every contender, run the rounds; rank 0 prints ``RESULT {json}``."""
    import torch

    import hvps.adapters.torch as hvd
    from fully_sharded import BlockStack, step

    torch.set_num_threads(1)
    hvd.init()
    contenders = args.contenders.split(",")
    if "zero" in contenders:
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())

    def build() -> tuple:
        torch.manual_seed(0)
        if args.model == "resnet50":
            from resnet import resnet50

            return resnet50(), (args.batch, 3, args.image, args.image)
        return BlockStack(args.width, args.depth, args.heads), (args.batch, args.seq, args.width)

    runs = {}
    for name in contenders:
        model, shape = build()
        adam = torch.optim.Adam(model.parameters(), foreach=False)
        if name == "zero":
            model = DistributedDataParallel(model)
            optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, foreach=False)
        elif name == "baseline":
            optimizer = _baseline_class(args.baseline_file)(adam, named_parameters=model.named_parameters())
        else:
            optimizer = hvd.DistributedOptimizer(adam, named_parameters=model.named_parameters(),
                                                 shard=name == "sharded")
        runs[name] = (model, optimizer)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1 + hvd.rank()))

    def timed(name: str) -> float:
        hvd.barrier()
        start = time.perf_counter()
        step(*runs[name], x)
        return float(hvd.allreduce(torch.tensor([time.perf_counter() - start]), op=hvd.Max))

    for name in contenders:  # warm-up: state built, buffers allocated
        timed(name)
    rounds = []
    for _ in range(args.rounds):
        load = os.getloadavg()[0]
        rounds.append({"load": round(load, 2), **{name: statistics.median(timed(name) for _ in range(args.steps))
                                                  for name in contenders}})
    if hvd.rank() == 0:
        print("RESULT " + json.dumps(rounds), flush=True)
    hvd.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks")
    p.add_argument("--contenders", default="replicated,sharded,zero", help="comma-separated, from "
                   + ", ".join(CONTENDERS))
    p.add_argument("--baseline-file", default="", help="the sharded_optimizer.py the baseline contender uses")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps of each contender per round")
    p.add_argument("--model", choices=("blocks", "resnet50"), default="blocks")
    p.add_argument("--image", type=int, default=64, help="resnet50: image side in pixels")
    add_model_arguments(p)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the job")
    args = parse_contender_arguments(p, CONTENDERS)
    if args.worker:
        worker(args)
        return
    contenders = args.contenders.split(",")
    if "baseline" in contenders and not args.baseline_file:
        p.error("the baseline contender needs --baseline-file")
    from hvps.runner.mpi_discovery import find_mpirun

    with socket.socket() as s:  # a free port for torch.distributed's rendezvous (the zero contender)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = [find_mpirun().path, "-np", str(args.np), "--oversubscribe", sys.executable, __file__, "--worker",
            *sys.argv[1:]]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    results = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not results:
        sys.exit(f"the job failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    rounds = json.loads(results[0])
    medians = {c: statistics.median(r[c] for r in rounds) for c in contenders}
    summary = {"np": args.np, "model": args.model, "width": args.width, "depth": args.depth,
               "rounds": [{k: round(v, 4) for k, v in r.items()} for r in rounds],
               "median_step_s": {c: round(m, 4) for c, m in medians.items()}}
    if "replicated" in medians:  # the ratio of medians, and the median of each round's ratio (its pairs share a load)
        summary["replicated_over"] = {c: round(medians["replicated"] / m, 3) for c, m in medians.items()}
        summary["replicated_over_by_round"] = {
            c: round(statistics.median(r["replicated"] / r[c] for r in rounds), 3) for c in contenders}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
