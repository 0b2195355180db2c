"""What hvps's Prometheus metrics cost a ResNet-50 training step (target: < 0.5%).

The driver launches the workers under mpirun and scrapes every rank's exporter, as Prometheus
would, every --scrape-interval seconds. The workers train ResNet-50 (the harness's Trainer:
DistributedOptimizer, synthetic data) and alternate phases with metrics off
(``hvps.metrics.stop()``: the hooks see a ``None`` sink) and on (``hvps.metrics.serve()``),
in the order off-on, on-off, ... so that a drift in machine speed cancels. Each phase's step
time is the median over its steps and ranks; the overhead is the median over rounds of
on/off - 1. Everything runs in the same processes, so both sides share the model, the data and
the warm caches. CPU time per step (all threads of the rank: training, engine, exporter) is
compared the same way; it is less disturbed by other work on the machine than wall time.

On a shared or small machine the rounds scatter by more than the 0.5% target, so the workers
also cost the metrics directly: one real ``collective`` observation (arguments captured from
a training step and replayed), the optimizer's three hooks, and one scrape's text generation,
timed in a loop; ``estimated_overhead_pct`` is their cost per step over the step time, plus a
scrape per --scrape-interval.

    python benchmarks/metrics_overhead.py --np 2 --image-size 64 --batch-size 8 --json results/metrics-overhead.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import DEFAULT_MPIRUN_ARGS, MPIRUN_HELP, run_mpi_worker, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="images per rank per step (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=64, help="input side in pixels (default: %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per phase (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=6, help="off/on rounds (default: %(default)s)")
    p.add_argument("--scrape-interval", type=float, default=1.0,
                   help="seconds between scrapes of each rank while metrics are on (default: %(default)s; "
                        "Prometheus's default is 60 s, so this is a heavy case)")
    p.add_argument("--port", type=int, default=0, help="base metrics port (default: a free one)")
    p.add_argument("--mpirun", default=None, help=MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS, help="extra mpirun flags (default: '%(default)s')")
    p.add_argument("--json", default="", help="write the result here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- worker (under mpirun) -----------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from mpi4py import MPI

    import hvps.adapters.torch as hvd
    from benchmarks.pytorch_synthetic_benchmark import Trainer
    from benchmarks.pytorch_synthetic_benchmark import parse_args as harness_args
    from hvps import metrics

    hvd.init()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    harness = harness_args(["--batch-size", str(args.batch_size), "--image-size", str(args.image_size)])
    trainer = Trainer(harness, hvd, hvd.size())
    for _ in range(args.warmup_steps):
        trainer.step()
    load_before = os.getloadavg()
    rounds, collectives_per_step = [], None
    for r in range(args.rounds):
        times = {}
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            if mode == "on":
                exporter = metrics.current() or metrics.serve(args.port)
                before = _collectives(exporter)
            else:
                metrics.stop()
            comm.Barrier()
            cpu = time.process_time()
            steps = [trainer.step()[0] for _ in range(args.steps)]
            cpu = (time.process_time() - cpu) / args.steps
            if mode == "on":
                collectives_per_step = (_collectives(exporter) - before) / args.steps
            times[mode] = statistics.median(comm.allgather(statistics.median(steps)))
            times[f"cpu_{mode}"] = statistics.fmean(comm.allgather(cpu))
        rounds.append({**times, "ratio": times["on"] / times["off"], "cpu_ratio": times["cpu_on"] / times["cpu_off"]})
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: off {times['off']:.4f} s, on {times['on']:.4f} s, "
                  f"on/off {rounds[-1]['ratio']:.4f}, CPU on/off {rounds[-1]['cpu_ratio']:.4f}", flush=True)
    costs = _direct_costs(trainer, metrics.current() or metrics.serve(args.port))
    metrics.stop()
    if rank == 0:
        ratio = statistics.median(x["ratio"] for x in rounds)
        cpu_ratio = statistics.median(x["cpu_ratio"] for x in rounds)
        step_s = statistics.median(x["off"] for x in rounds)
        per_step = collectives_per_step * costs["collective_hook_s"] + costs["optimizer_hooks_s"]
        estimate = 100 * (per_step / step_s + costs["scrape_s"] / args.scrape_interval)
        write_json(args.json, {
            "benchmark": "metrics_overhead", "ranks": hvd.size(), "batch_size": args.batch_size,
            "image_size": args.image_size, "steps_per_phase": args.steps, "rounds": rounds,
            "median_step_s_off": statistics.median(x["off"] for x in rounds),
            "median_step_s_on": statistics.median(x["on"] for x in rounds),
            "median_ratio_on_over_off": ratio, "overhead_pct": 100 * (ratio - 1), "target_pct": 0.5,
            "median_cpu_ratio_on_over_off": cpu_ratio, "cpu_overhead_pct": 100 * (cpu_ratio - 1),
            "spread_of_round_ratios": [min(x["ratio"] for x in rounds), max(x["ratio"] for x in rounds)],
            "collectives_per_step_per_rank": collectives_per_step, "direct_costs_s": costs,
            "hook_seconds_per_step": per_step, "estimated_overhead_pct": estimate,
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "cpus": os.cpu_count()})
    hvd.shutdown()
    comm.Free()


def _direct_costs(trainer: Any, exporter: Any) -> dict[str, float]:
    """Seconds per call of the metrics' work, timed in a loop on real arguments."""
    from prometheus_client import generate_latest

    from hvps import metrics

    class Capture:  # records the engine's arguments of one real collective observation
        def __init__(self, inner: Any) -> None:
            self.inner, self.args = inner, None

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def collective(self, *args: Any) -> None:
            self.args = args
            self.inner.collective(*args)

    instruments = exporter.instruments
    capture = metrics._sink = Capture(instruments)
    while capture.args is None:  # the engine observes after the results are out: wait for one
        trainer.step()
    metrics._sink = instruments

    def per_call(func: Any, *args: Any, n: int = 2000) -> float:
        started = time.perf_counter()
        for _ in range(n):
            func(*args)
        return (time.perf_counter() - started) / n

    def optimizer_hooks() -> None:
        instruments.step()
        instruments.sync_started()
        instruments.sync_finished(trainer.compression)

    costs = {"collective_hook_s": per_call(instruments.collective, *capture.args),
             "optimizer_hooks_s": per_call(optimizer_hooks) + per_call(instruments.samples, 8),
             "scrape_s": per_call(generate_latest, exporter.registry, n=100)}
    metrics._sink = None
    costs["hook_while_off_s"] = per_call(metrics.on_collective, *capture.args)
    metrics._sink = instruments
    return costs


def _collectives(exporter: Any) -> float:
    return sum(s.value for f in exporter.registry.collect() if f.name == "hvps_collectives" for s in f.samples
               if s.name == "hvps_collectives_total")


# -- driver ---------------------------------------------------------------------------------
class Scraper:
    """Scrapes ports base .. base+n-1 every ``interval`` seconds in a thread (refused: metrics off)."""

    def __init__(self, base: int, n: int, interval: float) -> None:
        self.urls = [f"http://127.0.0.1:{base + i}/metrics" for i in range(n)]
        self.interval, self.seconds, self.done = interval, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.done.wait(self.interval):
            for url in self.urls:
                started = time.perf_counter()
                try:
                    urllib.request.urlopen(url, timeout=5).read()
                except OSError:
                    continue
                self.seconds.append(time.perf_counter() - started)


def _free_base(n: int) -> int:
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    port = args.port or _free_base(args.np)
    scraper = Scraper(port, args.np, args.scrape_interval)
    scraper.thread.start()
    forwarded = ["--worker", "--port", str(port)] + [
        x for key in ("batch_size", "image_size", "warmup_steps", "steps", "rounds")
        for x in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]
    try:
        result = run_mpi_worker(args.np, __file__, forwarded, env={"OMPI_MCA_mpi_yield_when_idle": "1"},
                                mpirun=args.mpirun, mpirun_args=args.mpirun_args)
    finally:
        scraper.done.set()
        scraper.thread.join()
    result.update(scrape_interval_s=args.scrape_interval, scrapes=len(scraper.seconds),
                  median_scrape_s=statistics.median(scraper.seconds) if scraper.seconds else None)
    print(f"metrics on/off step time: {result['median_ratio_on_over_off']:.4f} "
          f"(overhead {result['overhead_pct']:+.2f}%, target < {result['target_pct']}%, rounds "
          f"{result['spread_of_round_ratios'][0]:.3f}..{result['spread_of_round_ratios'][1]:.3f}); CPU time "
          f"{result['cpu_overhead_pct']:+.2f}%; estimated from direct costs {result['estimated_overhead_pct']:.3f}%; "
          f"{result['collectives_per_step_per_rank']:.1f} collectives per step and rank; "
          f"{result['scrapes']} scrapes, median {1e3 * (result['median_scrape_s'] or 0):.1f} ms; "
          f"load {result['load_average_before'][0]:.2f} -> {result['load_average_after'][0]:.2f}", flush=True)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
