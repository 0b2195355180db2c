"""Gradient-compression benchmark (issue 4), everything side by side in one run:

1. **Bytes on the wire** for ResNet-50's gradients (``benchmarks/resnet.py``:
   161 tensors, 25,557,032 float32) per compression: the payload sizes of a
   single-process compress (each compression's own pipeline steps: error
   feedback, compress), against the dense float32 gradients. With ``--np N``
   (default 2) the same gradients also go through ``GradientCompression``
   under a real ``mpirun -np N`` and the pipeline's own statistics
   (``bytes_sent`` / ``bytes_received`` / ``dense_bytes``, dense = what a ring
   allreduce moves) are reported next to the computed figures.
2. **Selection time** on CPU for one 25.6 M-element float32 tensor at
   ``--density``: sampled-threshold selection (``hvps.compression.selection.
   sampled_topk``, DGC's) vs ``torch.topk`` vs exact numpy ``argpartition``,
   each including the ``abs``; alternating A B C A B C, medians over ``--runs``.
3. **Compress / decompress time per step** for each compression over the
   ResNet-50 gradients (decompress = what the handle's ``wait`` does at 2 ranks: decompress
   the summed payload, or aggregate two ranks' gathered payloads), alternating
   compressions step by step, medians over ``--steps``; with the time a
   ``--link-gbit`` link would need for the dense and the compressed bytes
   (computed, not measured on a link).

PowerSGD (``--powersgd-rank``, default 4; issue 28) exchanges in two rounds, so it has no
single-process compress: it appears in part 1's mpirun statistics only (bytes, and its
compress / decompress seconds from the pipeline's own ``compression_stats()``).
``benchmarks/powersgd.py`` compares it with DDP's ``powerSGD_hook`` on training steps.

    python benchmarks/compression.py --json out/compression.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import DEFAULT_MPIRUN_ARGS, MPIRUN_HELP, median, run_mpi_worker, summarize, write_json  # noqa: E402

RESNET50_NUMEL = 25_557_032


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--density", type=float, default=0.01, help="top-k density (default: %(default)s)")
    p.add_argument("--dgc-density", type=float, default=0.001,
                   help="DGC's final density, no warm-up (default: %(default)s)")
    p.add_argument("--powersgd-rank", type=int, default=4,
                   help="PowerSGD's matrix rank; 0 leaves PowerSGD out (default: %(default)s)")
    p.add_argument("--runs", type=int, default=5, help="selection timings per method (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3,
                   help="compress/decompress steps per compression (default: %(default)s)")
    p.add_argument("--numel", type=int, default=RESNET50_NUMEL,
                   help="elements of the selection benchmark's tensor (default: %(default)s)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch intra-op threads for torch.topk (0: torch's default) (default: %(default)s)")
    p.add_argument("--link-gbit", type=float, default=1.0,
                   help="link rate for the computed transfer times, Gbit/s (default: %(default)s)")
    p.add_argument("--np", type=int, default=2,
                   help="ranks of the mpirun that counts the pipeline's statistics; 0 skips it (default: %(default)s)")
    p.add_argument("--worker", action="store_true", help="worker mode (run under mpirun by the driver)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: selection,compress,mpirun")
    p.add_argument("--mpirun", default=None, help=MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS, help="extra mpirun flags (default: '%(default)s')")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed for the mpirun (default: %(default)s)")
    p.add_argument("--json", default="", help="write results as JSON to this path")
    p.add_argument("--verbose", action="store_true", help="echo the mpirun command")
    args = p.parse_args(argv)
    for name in ("density", "dgc_density"):
        if not 0 < getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    return args


def compressions(args: argparse.Namespace) -> dict:
    """name -> factory of a fresh ``GradientCompression``."""
    from hvps import compression as C

    d, dd = args.density, args.dgc_density
    found = {
        "none": lambda: C.create("none"),
        "fp16": lambda: C.create("fp16"),
        "bf16": lambda: C.create("bf16"),
        "int8": lambda: C.create("int8"),
        f"topk({d})": lambda: C.create("topk", density=d),
        f"topk({d},exact)": lambda: C.create("topk", density=d, selection="exact"),
        f"dgc({dd})": lambda: C.create("dgc", density=dd, warmup=()),
    }
    if args.powersgd_rank:
        found[f"powersgd({args.powersgd_rank})"] = lambda: C.create("powersgd", rank=args.powersgd_rank, start_iter=0)
    return found


def two_rounds(gc) -> bool:
    """PowerSGD: no one-shot compress to time in a single process."""
    from hvps.compression import PowerSGDCompression

    return isinstance(gc, PowerSGDCompression)


def resnet50_gradients(seed: int) -> list:
    """(name, float32 array) for every ResNet-50 parameter: fresh normal data."""
    from benchmarks.resnet import resnet50

    rng = np.random.default_rng(seed)
    return [(name, rng.standard_normal(tuple(p.shape), dtype=np.float32))
            for name, p in resnet50().named_parameters()]


def local_step(gc, array: np.ndarray, name: str, size: int):
    """``GradientCompression.start``'s local half (error feedback, prescale, compress)."""
    compensated = gc.memory.compensate(array, name)
    prescale = gc.compressor.prescale(size)
    if prescale != 1.0:
        compensated = (compensated * np.float32(prescale)).astype(compensated.dtype, copy=False)
    payloads, ctx = gc.compressor.compress(compensated, name)
    gc.memory.update(compensated, name, gc.compressor, payloads, ctx)
    return payloads, ctx


def rebuild(gc, payloads: list, ctx, size: int) -> np.ndarray:
    """What the exchange's handle returns from what ``size`` ranks sent (every rank sent ``payloads`` here)."""
    if gc.summable:
        return gc.compressor.decompress(payloads, ctx)
    return gc.compressor.aggregate([np.concatenate([p.reshape(-1)] * size) for p in payloads], ctx, size)


# ----------------------------------------------------------------------------- 1 + 3: bytes and time
def bench_compress(args: argparse.Namespace, grads: list) -> dict:
    factories = compressions(args)
    pipes = {name: gc for name, gc in ((n, make()) for n, make in factories.items()) if not two_rounds(gc)}
    dense = sum(g.nbytes for _, g in grads)
    out = {name: {"compress_s": [], "decompress_s": [], "payload_bytes": None} for name in pipes}
    for step in range(args.steps):
        order = list(pipes) if step % 2 == 0 else list(reversed(pipes))  # alternate the order
        for name in order:
            gc = pipes[name]
            sent = []
            t0 = time.perf_counter()
            for tname, g in grads:
                sent.append(local_step(gc, g, tname, 2))
            t1 = time.perf_counter()
            for payloads, ctx in sent:
                rebuild(gc, payloads, ctx, 2)
            t2 = time.perf_counter()
            out[name]["compress_s"].append(t1 - t0)
            out[name]["decompress_s"].append(t2 - t1)
            nbytes = sum(p.nbytes for payloads, _ in sent for p in payloads)
            if out[name]["payload_bytes"] is None or step == args.steps - 1:
                out[name]["payload_bytes"] = int(nbytes)
            del sent
    rate = args.link_gbit * 1e9 / 8
    for name, r in out.items():
        r["compress_median_s"] = median(r["compress_s"])
        r["decompress_median_s"] = median(r["decompress_s"])
        r["dense_bytes"] = dense
        r["ratio"] = dense / r["payload_bytes"]
        r["summable"] = pipes[name].summable
        # per rank at 2 ranks: ring allreduce moves 2(n-1)/n = 1x the buffer, allgather (n-1) = 1x
        r["link_s_2ranks"] = r["payload_bytes"] / rate
        r["link_saving_s_2ranks"] = (dense - r["payload_bytes"]) / rate
        r["net_saving_s_2ranks"] = r["link_saving_s_2ranks"] - r["compress_median_s"] - r["decompress_median_s"]
    return out


# ----------------------------------------------------------------------------- 2: selection
def bench_selection(args: argparse.Namespace) -> dict:
    import torch

    from hvps.compression.selection import exact_topk, sampled_topk

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    n = args.numel
    k = max(1, int(n * args.density))
    x = np.random.default_rng(7).standard_normal(n, dtype=np.float32)
    t = torch.from_numpy(x)
    rng = np.random.default_rng(0)
    methods = {
        "sampled": lambda: sampled_topk(np.abs(x), k, rng=rng),
        "torch.topk": lambda: torch.topk(t.abs(), k, sorted=False).indices,
        "numpy.argpartition": lambda: exact_topk(np.abs(x), k),
    }
    chosen = {name: fn() for name, fn in methods.items()}  # warm-up, and the results to check
    mags = np.abs(x)
    kth = mags[chosen["numpy.argpartition"]].min()
    sampled = chosen["sampled"]
    check = {
        "sampled_count": int(sampled.size), "k": k,
        "sampled_within_0.8k_k": bool(0.8 * k <= sampled.size <= k),
        "sampled_all_at_least_kth_largest": bool(mags[sampled].min() >= kth),
        "torch_matches_exact": bool(np.array_equal(np.sort(chosen["torch.topk"].numpy()),
                                                   np.sort(chosen["numpy.argpartition"]))),
    }
    times = {name: [] for name in methods}
    for run in range(args.runs):
        order = list(methods) if run % 2 == 0 else list(reversed(methods))
        for name in order:
            t0 = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t0)
    med = {name: median(v) for name, v in times.items()}
    return {"numel": n, "density": args.density, "k": k, "torch_threads": torch.get_num_threads(),
            "times_s": times, "median_s": med, "stats": {n_: summarize(v) for n_, v in times.items()},
            "speedup_vs_torch_topk": med["torch.topk"] / med["sampled"],
            "speedup_vs_argpartition": med["numpy.argpartition"] / med["sampled"],
            "per_run_speedup_vs_torch_topk": [a / b for a, b in zip(times["torch.topk"], times["sampled"])],
            "check": check, "target_speedup_vs_torch_topk": 5.0}


# ----------------------------------------------------------------------------- mpirun: pipeline stats
def run_worker(args: argparse.Namespace) -> None:
    import hvps

    hvps.init()
    rank, size = hvps.rank(), hvps.size()
    grads = resnet50_gradients(seed=100 + rank)
    result = {"ranks": size, "tensors": len(grads), "numel": sum(g.size for _, g in grads), "stats": {}}
    for name, make in compressions(args).items():
        gc = make()
        hvps.barrier()
        t0 = time.perf_counter()
        pending = [gc.start(g.copy(), f"{name}.{tname}") for tname, g in grads]
        for p in pending:
            p.wait()
        elapsed = time.perf_counter() - t0
        stats = gc.stats.as_dict()
        stats["exchange_s"] = elapsed
        per_rank = hvps.allgather_object(stats, name=f"stats.{name}")
        result["stats"][name] = per_rank
        del gc, pending
    if rank == 0:
        write_json(args.json, result)
    hvps.shutdown()


def run_mpi_stats(args: argparse.Namespace) -> dict:
    worker_args = ["--worker", "--density", str(args.density), "--dgc-density", str(args.dgc_density),
                   "--powersgd-rank", str(args.powersgd_rank)]
    return run_mpi_worker(args.np, __file__, worker_args, mpirun=args.mpirun, mpirun_args=args.mpirun_args,
                          timeout=args.timeout, verbose=args.verbose)


# ----------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return {}
    skip = set(filter(None, args.skip.split(",")))
    result: dict = {"benchmark": "compression", "density": args.density, "dgc_density": args.dgc_density,
                    "link_gbit": args.link_gbit,
                    "note": "2 shared CPU cores with other work running concurrently: preliminary numbers"}
    if "selection" not in skip:
        print(f"# selection: {args.numel:,} float32 at density {args.density}, {args.runs} runs each, alternating",
              flush=True)
        sel = bench_selection(args)
        result["selection"] = sel
        for name, m in sel["median_s"].items():
            print(f"  {name:20s} median {m * 1e3:9.1f} ms")
        print(f"  sampled vs torch.topk: {sel['speedup_vs_torch_topk']:.1f}x faster (target >= 5x); "
              f"vs argpartition {sel['speedup_vs_argpartition']:.1f}x; torch threads {sel['torch_threads']}; "
              f"check {sel['check']}", flush=True)
    if "compress" not in skip:
        grads = resnet50_gradients(seed=100)
        numel = sum(g.size for _, g in grads)
        print(f"\n# ResNet-50 gradients: {len(grads)} tensors, {numel:,} float32 ({numel * 4 / 2**20:.1f} MiB); "
              f"payload sizes from a single-process compress, {args.steps} steps each, alternating", flush=True)
        comp = bench_compress(args, grads)
        result["resnet50"] = {"tensors": len(grads), "numel": numel, "per_compression": comp,
                              "bytes_counted_from": "payload sizes of a single-process compress (per rank, per step)"}
        print(f"  {'compression':18s} {'payload/step':>14s} {'fewer':>8s} {'compress':>10s} {'decompress':>11s} "
              f"{'link@' + str(args.link_gbit) + 'G':>10s} {'net saving':>11s}")
        for name, r in comp.items():
            print(f"  {name:18s} {r['payload_bytes'] / 2**20:11.2f} MiB {r['ratio']:7.1f}x "
                  f"{r['compress_median_s'] * 1e3:8.0f} ms {r['decompress_median_s'] * 1e3:9.0f} ms "
                  f"{r['link_s_2ranks'] * 1e3:8.0f} ms {r['net_saving_s_2ranks'] * 1e3:9.0f} ms", flush=True)
        del grads
    if args.np > 0 and "mpirun" not in skip:
        print(f"\n# the same gradients through GradientCompression under mpirun -np {args.np} "
              f"(pipeline statistics, rank 0 / all ranks)", flush=True)
        mpi = run_mpi_stats(args)
        result["mpirun"] = mpi
        for name, per_rank in mpi["stats"].items():
            s0 = per_rank[0]
            print(f"  {name:18s} sent {s0['bytes_sent'] / 2**20:9.2f} MiB  received "
                  f"{s0['bytes_received'] / 2**20:9.2f} MiB  dense(ring) {s0['dense_bytes'] / 2**20:8.2f} MiB  "
                  f"ratio {s0['ratio']:7.1f}x  compress {s0['compress_seconds'] * 1e3:6.0f} ms  decompress "
                  f"{s0['decompress_seconds'] * 1e3:5.0f} ms  (ranks' sent: "
                  + ", ".join(f"{s['bytes_sent']}" for s in per_rank) + ")", flush=True)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
