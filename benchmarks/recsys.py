"""DLRM-style recommendation benchmark for the sharded parameter store (issue 16).

A bottom MLP over 13 dense features, ``--tables`` embedding tables (``--rows`` x ``--dim``, one
id per table per sample, ids Zipf-distributed with exponent ``--alpha``), a top MLP, binary
cross-entropy on synthetic clicks drawn from a hidden teacher (so the loss can fall).  The dense
MLPs go through ``hvd.DistributedOptimizer`` (ring allreduce) in every variant; the tables:

* ``store``   ``hvps.store.ShardedEmbeddingBag`` (row-wise sharded, SGD applied by the owners, an
  LRU cache of ``--cache-frac`` of the rows asked for: the table builds it only where it pays, in
  front of the disk tier or on a GPU, and reports ``cache bypassed: host tier`` otherwise);
  ``store-stale`` the same with ``--staleness``;
  ``store-disk`` the same on the memory-mapped disk tier; with ``--prefetch`` (the default) each
  step prefetches the next batch's lookup (``store-stale``: the whole lookup overlaps the step),
  with ``--prefetch-depth 2`` the batch after next (``prefetch_depth=2``);
  ``--exchange alltoall|gather`` forces the push the store otherwise chooses by bytes;
* ``dense``   a replicated ``nn.EmbeddingBag`` whose gradient is allreduced whole
  (Horovod's ``sparse_as_dense``);
* ``sparse``  a replicated ``nn.EmbeddingBag(sparse=True)``: hvps's sparse allgather path;
* ``mlp``     no tables (zeros in place of the pooled rows): the dense part alone, so each
  variant's embedding cost is its step time minus this one.

Every variant runs in its own ``mpirun`` job, variants alternating round by round; rank 0
reports step time (slowest rank), CPU time per step (the process's, all threads; median over
ranks), samples/s per rank, embedding bytes on the wire per step
(store: payload it sent; dense: ring allreduce 2(n-1)/n of the table; sparse: (n-1) x its
indices + values), cache hit rates, distinct ids per step, RSS per rank and the final loss.

    python benchmarks/recsys.py --np 2 --rows 4000000 --variants store,sparse,dense --rounds 3
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import median, run_mpi_worker, write_json  # noqa: E402

DENSE_FEATURES = 13
VARIANTS = ("store", "store-stale", "store-disk", "sparse", "dense", "mlp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (mpirun -np)")
    p.add_argument("--variants", default="store,sparse,dense", help=f"comma list of {VARIANTS}")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (median over rounds)")
    p.add_argument("--rows", type=int, default=4_000_000, help="rows per embedding table")
    p.add_argument("--dim", type=int, default=64, help="embedding width (floats per row)")
    p.add_argument("--tables", type=int, default=1, help="embedding tables (one id per table per sample)")
    p.add_argument("--batch", type=int, default=2048, help="samples per rank per step")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--cache-frac", type=float, default=0.05, help="cache size as a fraction of the rows")
    p.add_argument("--cache-policy", default="lru", choices=("lru", "lfu"), help="cache eviction policy")
    p.add_argument("--staleness", type=int, default=2, help="steps a row may lag (store-stale only)")
    p.add_argument("--combine", default="local", choices=("local", "ordered"),
                   help="store gradient combining: per member first (local) or in global batch order")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="store variants: prefetch the next batch's lookup during each step")
    p.add_argument("--prefetch-depth", type=int, default=1, choices=(1, 2),
                   help="store (synchronous) variants: prefetch this many batches ahead")
    p.add_argument("--exchange", default="auto", choices=("auto", "alltoall", "gather"),
                   help="store variants: push by alltoall or gather every step instead of choosing by bytes")
    p.add_argument("--disk-dir", default="/tmp/hvps-recsys", help="where store-disk keeps its shard files")
    p.add_argument("--warmup", type=int, default=40, help="untimed steps (store variants: cache warm-up)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--dense-steps", type=int, default=5, help="timed steps of the dense variant (slow)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (dense SGD and the tables' SGD)")
    p.add_argument("--json", default=None, help="write every run and the medians to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker side
class ZipfIds:
    """Bounded Zipf(alpha) ids in [0, rows): inverse CDF over k^-alpha, k = 1..rows."""

    def __init__(self, rows: int, alpha: float, seed: int) -> None:
        weights = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
        self.cdf = np.cumsum(weights)
        self.cdf /= self.cdf[-1]
        self.rng = np.random.default_rng(seed)

    def draw(self, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, self.rng.random(n)), len(self.cdf) - 1)


def _rss() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _teacher_logit(ids_per_table, x):
    """The hidden click model: a fixed score per id plus a linear term on the dense features."""

    from hvps.store.init import hash_uniform

    score = sum(hash_uniform(ids, 1, seed=99 + t, low=-2, high=2).view(-1) for t, ids in enumerate(ids_per_table))
    return score + x[:, :3].sum(dim=1) * 0.5


def _model(args, variant, hvd):
    import torch
    from torch import nn

    from hvps.store import ShardedEmbeddingBag

    torch.manual_seed(0)
    bottom = nn.Sequential(nn.Linear(DENSE_FEATURES, 64), nn.ReLU(), nn.Linear(64, args.dim), nn.ReLU())
    top = nn.Sequential(nn.Linear(args.dim * (args.tables + 1), 64), nn.ReLU(), nn.Linear(64, 1))
    tables = []
    for t in range(args.tables if variant != "mlp" else 0):
        if variant.startswith("store"):
            shard_rows = -(-args.rows // hvd.size())
            tables.append(ShardedEmbeddingBag(
                args.rows, args.dim, mode="sum", name=f"table{t}", lr=args.lr,
                cache_rows=max(1, int(args.cache_frac * shard_rows)), cache_policy=args.cache_policy,
                staleness=args.staleness if variant == "store-stale" else 0, combine=args.combine,
                tier="disk" if variant == "store-disk" else "host", disk_dir=args.disk_dir,
                prefetch_depth=args.prefetch_depth if variant != "store-stale" else 1))
        else:
            bag = nn.EmbeddingBag(args.rows, args.dim, mode="sum", sparse=variant == "sparse")
            bound = (1.0 / args.rows) ** 0.5
            nn.init.uniform_(bag.weight, -bound, bound)
            tables.append(bag)
    return bottom, top, nn.ModuleList(tables)


def worker(args) -> None:
    import torch

    import hvps.adapters.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    variant = args.worker
    if args.exchange != "auto":  # force one way (hvps/store/exchange.py: gather_pays)
        from hvps.store import exchange

        exchange.GATHER_EXTRA_BYTES = float("inf") if args.exchange == "gather" else -1
    t0 = time.perf_counter()
    bottom, top, tables = _model(args, variant, hvd)
    build_s = time.perf_counter() - t0
    store = variant.startswith("store")
    dense_params = list(bottom.parameters()) + list(top.parameters())
    named = [(f"p{i}", p) for i, p in enumerate(dense_params)]
    if not store:
        dense_params += list(tables.parameters())
        named += [(f"table{i}", p) for i, p in enumerate(tables.parameters())]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(dense_params, lr=args.lr), named_parameters=named,
                                         sparse_as_dense=variant == "dense")
    hvd.broadcast_parameters(dict(named), root_rank=0)
    zipf = [ZipfIds(args.rows, args.alpha, seed=1000 * hvd.rank() + t) for t in range(args.tables)]
    data_rng = torch.Generator().manual_seed(hvd.rank())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    timed = args.dense_steps if variant == "dense" else args.steps
    warmup = min(args.warmup, 3) if variant == "dense" else args.warmup
    times, cpu, losses, distinct, wire, access = [], [], [], [], [], [0, 0]
    prefetch = store and args.prefetch
    depth = args.prefetch_depth if prefetch and variant != "store-stale" else 1
    zeros = torch.zeros(args.batch, args.dim * args.tables)  # mlp: no tables

    def draw() -> tuple:
        ids = [torch.from_numpy(z.draw(args.batch)).view(-1, 1) for z in zipf]
        x = torch.randn(args.batch, DENSE_FEATURES, generator=data_rng)
        y = torch.bernoulli(torch.sigmoid(_teacher_logit([i.view(-1) for i in ids], x)), generator=data_rng)
        return ids, x, y

    coming = [draw() for _ in range(depth)]  # the next batches, drawn outside the timed region
    for step in range(warmup + timed):
        (ids, x, y), coming = coming[0], [*coming[1:], draw()]
        if step == warmup:
            for t in tables if store else ():
                if t.table.cache is not None:
                    t.table.cache.stats.reset()
            sent0 = sum(t.exchange.bytes_sent for t in tables) if store else 0
        if step >= warmup and store and not prefetch:  # prefetched rows are cached before the step starts
            _count_resident(tables, ids, access, hvd)
        hvd.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        pooled = [table(i) for table, i in zip(tables, ids)] if variant != "mlp" else [zeros]
        for ahead in range(depth - 1 if step else 0, depth) if prefetch else ():  # step 0: batches 1..depth
            if step + 1 + ahead < warmup + timed:
                for table, i in zip(tables, coming[ahead][0]):
                    table.prefetch(i)
        logits = top(torch.cat([bottom(x), *pooled], dim=1)).view(-1)
        loss = loss_fn(logits, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
        if step >= warmup:
            times.append(elapsed)
            cpu.append(used)
            losses.append(float(loss.detach()))
            distinct.append(sum(int(torch.unique(i).numel()) for i in ids))
            wire.append(_wire_bytes(variant, args, ids, hvd))
        if variant == "store-disk":
            for t in tables:
                t.table.tier.trim()
    per_rank = {"times": times, "cpu": cpu, "losses": losses, "distinct": distinct, "rss": _rss(), "build_s": build_s,
                "wire": wire}
    if store:
        per_rank["sent"] = sum(t.exchange.bytes_sent for t in tables) - sent0
        per_rank["stats"] = [t.stats() for t in tables]
        per_rank["access"] = access
    everyone = hvd.allgather_object(per_rank)
    if hvd.rank() == 0 and args.json:
        write_json(args.json, _summarize(variant, args, everyone))
    hvd.shutdown()


def _count_resident(tables, ids, access, hvd) -> None:
    """Access-weighted hit rate: of every id occurrence in the global batch, how many find their
    row already in the owner's cache (benchmark-only side channel, outside the timed region).
    Not with --prefetch, whose lookups reach the owners before the step starts; caching is the
    same either way (the same rows are looked up in the same order)."""

    for table, local in zip(tables, ids):
        cache = table.table.cache
        every = hvd.allgather(local.view(-1))
        mine = table.table.partition.owner(every) == table.table.member
        slots = table.table.partition.slot(every[mine])
        access[0] += int((cache.slot_of[slots] >= 0).sum()) if cache is not None else 0
        access[1] += int(mine.sum())


def _wire_bytes(variant, args, ids, hvd) -> float:
    n = hvd.size()
    if variant == "dense":
        return args.tables * args.rows * args.dim * 4 * 2 * (n - 1) / n
    if variant == "sparse":  # indices (int64) + values (float32) of this rank's gradient to n-1 peers
        return sum(i.numel() * (8 + args.dim * 4) for i in ids) * (n - 1)
    if variant == "mlp":
        return 0.0
    return float("nan")  # the store counts its own


def _summarize(variant, args, ranks) -> dict:
    steps = len(ranks[0]["times"])
    slowest = [max(r["times"][s] for r in ranks) for s in range(steps)]
    step_s = median(slowest)
    out = {"variant": variant, "np": len(ranks), "rows": args.rows, "dim": args.dim, "tables": args.tables,
           "batch": args.batch, "step_s": step_s, "cpu_s": median([np.mean(r["cpu"]) for r in ranks]), "samples_per_s_per_rank": args.batch / step_s,
           "distinct_ids_per_step": median([np.mean([r["distinct"][s] for r in ranks]) for s in range(steps)]),
           "rss_bytes": [r["rss"].get("VmRSS", 0) for r in ranks], "hwm_bytes": [r["rss"].get("VmHWM", 0) for r in ranks],
           "rss_anon_bytes": [r["rss"].get("RssAnon", 0) for r in ranks],
           "final_loss": float(np.mean([np.mean(r["losses"][-5:]) for r in ranks])),
           "build_s": max(r["build_s"] for r in ranks)}
    if variant.startswith("store"):
        out["wire_bytes_per_step"] = float(np.mean([r["sent"] for r in ranks])) / steps
        stats = [s for r in ranks for s in r["stats"]]
        hits, misses = sum(s.get("hits", 0) for s in stats), sum(s.get("misses", 0) for s in stats)
        out["cache"] = stats[0]["cache"]  # "bypassed: host tier": no hit rates (hvps/store/table.py)
        out["hit_rate_distinct"] = hits / (hits + misses) if hits + misses else None
        resident = sum(r["access"][0] for r in ranks)
        total = sum(r["access"][1] for r in ranks)
        out["hit_rate_access"] = resident / total if total else None  # None: not measured (--prefetch)
        out["evictions"] = sum(s.get("evictions", 0) for s in stats)
        out["gathers"] = sum(s.get("gathers", 0) for s in stats) / len(stats)
        out["cache_bytes_per_rank"] = stats[0].get("cache_bytes", 0)
        out["shard_bytes_per_rank"] = stats[0].get("tier_bytes", 0)
        if variant == "store-stale":
            out["stale_reused"] = sum(s.get("stale_reused", 0) for s in stats)
            out["stale_pulled"] = sum(s.get("stale_pulled", 0) for s in stats)
    else:
        out["wire_bytes_per_step"] = float(np.mean([np.mean(r["wire"]) for r in ranks]))
    return out


# ----------------------------------------------------------------------------- driver side
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:])]
    passthrough = _strip(passthrough, ("--json", "--np", "--variants", "--rounds"))
    results: dict = {v: [] for v in variants}
    for round_ in range(args.rounds):
        for v in variants:
            res = run_mpi_worker(args.np, __file__, [*passthrough, "--worker", v], timeout=1800)
            results[v].append(res)
            print(f"round {round_ + 1} {v:12s} step {res['step_s'] * 1e3:9.2f} ms  cpu {res['cpu_s'] * 1e3:7.2f} ms  "
                  f"wire {res['wire_bytes_per_step'] / 1e6:10.3f} MB/step  "
                  f"rss {max(res['rss_bytes']) / 2**20:8.0f} MiB  loss {res['final_loss']:.4f}"
                  + (f"  cache {res['cache']} hit(distinct) {_rate(res['hit_rate_distinct'])}"
                     f" hit(access) {_rate(res['hit_rate_access'])}  gathers {res['gathers']:.0f}"
                     if "cache" in res else ""), flush=True)
    summary = {v: {key: median([r[key] for r in rs]) for key in rs[0] if isinstance(rs[0][key], (int, float))}
               for v, rs in results.items()}
    print("\nmedians over rounds:")
    for v, s in summary.items():
        print(f"  {v:12s} step {s['step_s'] * 1e3:9.2f} ms  samples/s/rank {s['samples_per_s_per_rank']:9.0f}  "
              f"wire {s['wire_bytes_per_step'] / 1e6:10.3f} MB/step  distinct ids {s['distinct_ids_per_step']:.0f}")
    if "store" in summary:
        for v in summary:
            print(f"  store speed-up vs {v}: {summary[v]['step_s'] / summary['store']['step_s']:.2f}x")
    if "mlp" in summary:  # the embedding part of each step: its time beyond the dense part alone
        for v, s in summary.items():
            s["embedding_s"] = s["step_s"] - summary["mlp"]["step_s"]
            print(f"  {v:12s} embedding part of the step {s['embedding_s'] * 1e3:8.2f} ms")
    write_json(args.json, {"args": vars(args), "runs": results, "medians": summary})


def _rate(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _strip(argv: list, options: tuple) -> list:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
