"""What hvps's timeline costs a ResNet-50 training step (target: <= 1%).

The workers train ResNet-50 (the harness's Trainer: DistributedOptimizer, synthetic data, 161 gradient tensors) and
alternate phases with the timeline off (``hvd.stop_timeline()``) and on (``hvd.start_timeline(path,
mark_cycles=True)``, Horovod's fullest setting: every collective's NEGOTIATE_<OP> and <OP> spans and a CYCLE_START
mark per engine cycle), in the order off-on, on-off, ... so that a drift in machine speed cancels. Each phase's step
time is the median over its steps and ranks; the overhead is the median over rounds of on/off - 1. Both sides run
in the same processes, with the same model, data and warm caches.

A loaded 2-core machine scatters rounds by more than 1%, so the workers also cost the timeline directly: the
events one step writes (counted in the file) times the cost of writing one event (timed in a loop, flushes
included); ``estimated_overhead_pct`` is that over the step time.

    python benchmarks/timeline_cost.py --np 2 --image-size 64 --batch-size 8 --json results/timeline-cost.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import DEFAULT_MPIRUN_ARGS, MPIRUN_HELP, run_mpi_worker, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (driver and ``--worker``)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="images per rank per step (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=64, help="input side in pixels (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps (default: %(default)s)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per phase (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="off/on rounds (default: %(default)s)")
    p.add_argument("--mpirun", default=None, help=MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS, help="extra mpirun flags (default: '%(default)s')")
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _events_in(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.startswith("{") and '"ph":"M"' not in line)


def _event_cost(directory: str, n: int = 20000) -> float:
    """Seconds to write one span, a flush every 4 spans (a collective's two spans, and its row's first sight)."""
    from hvps.core.timeline import Timeline

    timeline = Timeline(os.path.join(directory, "cost.json"), mark_cycles=True)
    start = time.perf_counter()
    for i in range(n):
        now = time.monotonic()
        timeline.span(f"allreduce.grad.{i % 161}", "ALLREDUCE", now, now, {"fused": 12, "dtype": "float32"})
        if i % 4 == 3:
            timeline.flush()
    cost = (time.perf_counter() - start) / n
    timeline.close()
    return cost


def worker(args: argparse.Namespace) -> None:
    """One rank: warm up, then alternate timeline-off and timeline-on phases; rank 0 writes the JSON."""
    import torch

    torch.set_num_threads(1)
    from mpi4py import MPI

    import hvps.adapters.torch as hvd
    from benchmarks.pytorch_synthetic_benchmark import Trainer
    from benchmarks.pytorch_synthetic_benchmark import parse_args as harness_args

    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    harness = harness_args(["--batch-size", str(args.batch_size), "--image-size", str(args.image_size)])
    trainer = Trainer(harness, hvd, hvd.size())
    for _ in range(args.warmup_steps):
        trainer.step()
    directory = tempfile.mkdtemp(prefix="hvps-timeline-")
    load_before = os.getloadavg()
    rounds, events_per_step = [], []
    for r in range(args.rounds):
        times = {}
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            path = os.path.join(directory, f"round{r}.json")
            if mode == "on":
                hvd.start_timeline(path, mark_cycles=True)
            comm.Barrier()
            steps = [trainer.step()[0] for _ in range(args.steps)]
            if mode == "on":
                hvd.stop_timeline()
                if rank == 0:
                    events_per_step.append(_events_in(path) / args.steps)
            times[mode] = statistics.median(comm.allgather(statistics.median(steps)))
        rounds.append({**times, "ratio": times["on"] / times["off"]})
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: off {times['off']:.4f} s, on {times['on']:.4f} s, "
                  f"on/off {rounds[-1]['ratio']:.4f}", flush=True)
    if rank == 0:
        cost = _event_cost(directory)
        ratio = statistics.median(x["ratio"] for x in rounds)
        step_s = statistics.median(x["off"] for x in rounds)
        events = statistics.median(events_per_step)
        write_json(args.json, {
            "benchmark": "timeline_cost", "ranks": hvd.size(), "batch_size": args.batch_size,
            "image_size": args.image_size, "steps_per_phase": args.steps, "rounds": rounds,
            "median_step_s_off": step_s, "median_step_s_on": statistics.median(x["on"] for x in rounds),
            "median_ratio_on_over_off": ratio, "overhead_pct": 100 * (ratio - 1), "target_pct": 1.0,
            "spread_of_round_ratios": [min(x["ratio"] for x in rounds), max(x["ratio"] for x in rounds)],
            "events_per_step": events, "seconds_per_event": cost,
            "estimated_overhead_pct": 100 * events * cost / step_s,
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "cpus": os.cpu_count()})
    hvd.shutdown()
    comm.Free()


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Launch the workers under mpirun and print rank 0's summary.

    Args:
        argv: the command line (default: ``sys.argv[1:]``).

    Returns:
        The result (as written to ``--json``), or None in a worker.
    """
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    forwarded = ["--worker"] + [x for key in ("batch_size", "image_size", "warmup_steps", "steps", "rounds")
                                for x in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
    result = run_mpi_worker(args.np, __file__, forwarded, env={"OMPI_MCA_mpi_yield_when_idle": "1"},
                            mpirun=args.mpirun, mpirun_args=args.mpirun_args)
    print(f"timeline on/off step time: {result['median_ratio_on_over_off']:.4f} "
          f"(overhead {result['overhead_pct']:+.2f}%, target <= {result['target_pct']}%, rounds "
          f"{result['spread_of_round_ratios'][0]:.3f}..{result['spread_of_round_ratios'][1]:.3f}); "
          f"{result['events_per_step']:.0f} events per step at {1e6 * result['seconds_per_event']:.1f} us: "
          f"estimated {result['estimated_overhead_pct']:.3f}% of a {result['median_step_s_off']:.3f} s step; "
          f"load {result['load_average_before'][0]:.2f} -> {result['load_average_after'][0]:.2f}", flush=True)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
