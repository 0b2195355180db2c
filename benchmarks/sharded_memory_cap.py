"""Sharded training under a per-rank memory cap (issue 39, "Scale", and the peak-RSS cross-check of "Memory").

Each contender trains the transformer block stack of ``benchmarks/fully_sharded.py`` with Adam for a few
steps in its own ``mpirun`` job, every rank inside its own memory cgroup capped at ``--cap-mib`` (cgroup v1's
``memory.limit_in_bytes`` or v2's ``memory.max``; root only). A rank that needs more than the cap is killed by
the kernel's OOM killer, so "fits" means the whole job finished. Contenders:

* ``replicated``: hvps's ``DistributedOptimizer`` (every rank holds all parameters, gradients, Adam state);
* ``stage2``: ``hvd.DistributedOptimizer(..., shard=True)`` (Adam state and gradients sharded);
* ``stage3``: ``hvd.fully_shard(model, units=[TransformerEncoderLayer])`` with a plain Adam.

Per rank it reports the cgroup's peak usage (what the cap is compared with); the process's resident bytes after
``init()``, its peak while building and wrapping the model, and its peak while training (``VmHWM`` reset in
between); the bytes it holds by count (parameters, gradients and optimizer state, each storage once); and the
median step time. The ranks run with a fixed ``MALLOC_MMAP_THRESHOLD_`` (``--malloc-mmap-threshold``): with
glibc's dynamic threshold, tensors of up to 32 MiB freed during a step (gradient buckets) stay in the heap, and
the measured peak RSS of stage 2 was ~2,300 MiB where the bytes it holds come to ~1,400.
Without ``--cap-mib`` it runs uncapped (the peak-RSS cross-check of the counted bytes). JSON on stdout.

``--tier disk --tier-dir DIR`` keeps the sharded contenders' Adam state in the disk tier (``stage2``:
``state_tier="disk"``; ``stage3``: ``hvd.DiskStateTier`` on the plain Adam), each rank's file under
``DIR/rank<r>`` (the replicated contender ignores it). ``--phases`` adds each rank's resident and peak bytes
after the forward, the backward and the step of every step (where a step's peak comes from).

    python benchmarks/sharded_memory_cap.py --np 2 --cap-mib 1800 --width 1024 --depth 8
    python benchmarks/sharded_memory_cap.py --np 2 --cap-mib 1300 --contenders stage2,stage3 --tier disk \\
        --tier-dir /var/tmp/hvps-tier

Measured (2026-12-06, 2 ranks on a 2-core VM shared with other jobs, load average 6-9, so step times are
rough; defaults: width 1024, depth 8, 101M parameters, Adam; cgroup v1 caps; tier on the VM's ext4 disk):
uncapped training peak RSS replicated 1,990 MiB, stage 2 1,626 (1,935 before its backward kept at most 4
reduce-scatters in flight; ~2,300 with glibc's dynamic malloc threshold), stage 3 1,801, stage 2 with the
disk tier 1,234. Cap 1,850: replicated OOM-killed, stage 2 (cgroup peak 1,522) and stage 3 (1,698) train.
Cap 1,550: stage 3 killed, stage 3 with the disk tier trains (20.0 s/step). Cap 1,300: stage 2 killed,
stage 2 with the disk tier trains (13.2 s/step; 20.6 without write-behind); at 1,150 too (12.0 s/step).
Uncapped, one after the other: stage 2 8.7 s/step in memory, 10.2 s/step with the disk tier.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CONTENDERS = ("replicated", "stage2", "stage3")
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


def cgroup_for(name: str, cap_bytes: int) -> tuple:
    """Create a memory cgroup capped at ``cap_bytes``: ``(procs file, peak file, directory)``.

    Raises:
        RuntimeError: neither cgroup v1's memory controller nor cgroup v2 is writable here.
    """
    if (V1 / "memory.limit_in_bytes").exists():
        path = V1 / name
        path.mkdir(exist_ok=True)
        (path / "memory.limit_in_bytes").write_text(str(cap_bytes))
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(cap_bytes))  # no escape into swap
        return path / "cgroup.procs", path / "memory.max_usage_in_bytes", path
    if (V2 / "cgroup.controllers").exists():
        path = V2 / name
        path.mkdir(exist_ok=True)
        (path / "memory.max").write_text(str(cap_bytes))
        if (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")
        return path / "cgroup.procs", path / "memory.peak", path
    raise RuntimeError("no writable memory cgroup (needs root and cgroup v1's memory controller or cgroup v2)")


def rss_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since start or the last reset) of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args) -> None:
    """One rank: train ``args.contender`` for ``args.steps`` steps and print this rank's figures as JSON."""
    import torch

    import hvps.adapters.torch as hvd
    from fully_sharded import BlockStack, held, step

    torch.set_num_threads(1)
    hvd.init()
    baseline = rss_bytes("VmRSS")
    torch.manual_seed(0)
    model = BlockStack(args.width, args.depth, args.heads)
    extra = []
    tier_dir = str(Path(args.tier_dir) / f"rank{hvd.rank()}") if args.tier == "disk" else None
    tier = None
    if args.contender == "stage3":
        hvd.fully_shard(model, units=[torch.nn.TransformerEncoderLayer])
        optimizer = torch.optim.Adam(model.parameters(), foreach=False)
        if tier_dir:
            tier = hvd.DiskStateTier(optimizer, tier_dir)
    elif args.contender == "stage2":
        tiering = {"state_tier": "disk", "disk_dir": tier_dir} if tier_dir else {}
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), foreach=False),
                                             named_parameters=model.named_parameters(), shard=True, **tiering)
        tier = optimizer.state_tier
    else:
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), foreach=False),
                                             named_parameters=model.named_parameters())
    x = torch.randn(args.batch, args.seq, args.width)
    construction_peak = rss_bytes("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on is the training's
    times, phases = [], []
    for _ in range(args.steps + 1):
        hvd.barrier()
        start = time.perf_counter()
        if args.phases:
            phases.append(phased_step(model, optimizer, x))
        else:
            step(model, optimizer, x)
        times.append(time.perf_counter() - start)
    if args.contender == "stage3":
        from hvps.adapters.torch.fully_sharded import FullyShardedModel

        extra = [p for u in FullyShardedModel.of(model).units for g in u.groups for p in g.full]
    elif args.contender == "stage2":  # its Adam state lives in the shards' buckets, not in optimizer.state
        extra = [v for entry in optimizer.local_state().values() for v in entry.values()]
    counted = held(model, optimizer, extra)
    print("RANK " + json.dumps({"rank": hvd.rank(), "step_s": statistics.median(times[1:]),
                                "counted_bytes": counted,
                                "rss_after_init_bytes": baseline, "construction_peak_rss_bytes": construction_peak,
                                "training_peak_rss_bytes": rss_bytes("VmHWM"),
                                "tier_file_bytes": tier.nbytes if tier is not None else 0,
                                **({"phases_mib": phases} if args.phases else {})}),
          flush=True)
    hvd.shutdown()


def phased_step(model, optimizer, x) -> dict:
    """One training step (as ``fully_sharded.step``) with ``VmRSS``/``VmHWM`` in MiB after each phase."""
    def mark() -> list:
        return [rss_bytes("VmRSS") >> 20, rss_bytes("VmHWM") >> 20]

    marks = {"start": mark()}
    optimizer.zero_grad(set_to_none=False)
    loss = model(x).square().mean()
    marks["forward"] = mark()
    loss.backward()
    marks["backward"] = mark()
    optimizer.step()
    marks["step"] = mark()
    return marks


def run_contender(args, contender: str) -> dict:
    """Launch one contender's job under the caps and gather what its ranks printed."""
    from hvps.runner.mpi_discovery import find_mpirun

    tag = f"hvps-cap-{os.getpid()}-{contender}"
    groups = []
    try:
        prefix = ""
        if args.cap_mib:
            groups = [cgroup_for(f"{tag}-r{r}", args.cap_mib << 20) for r in range(args.np)]
            procs = " ".join(shlex.quote(str(g[0])) for g in groups)
            # each rank moves itself into its own capped cgroup before Python starts
            prefix = (f"set -- {procs}; shift ${{OMPI_COMM_WORLD_RANK:-${{PMI_RANK:-0}}}}; "
                      "echo $$ > \"$1\"; exec ")
        command = " ".join(shlex.quote(a) for a in [
            sys.executable, __file__, "--worker", "--contender", contender, "--width", str(args.width),
            "--depth", str(args.depth), "--heads", str(args.heads), "--batch", str(args.batch),
            "--seq", str(args.seq), "--steps", str(args.steps), "--tier", args.tier, "--tier-dir", args.tier_dir]
            + (["--phases"] if args.phases else []))
        argv = [find_mpirun().path, "-np", str(args.np), "--oversubscribe", "sh", "-c", prefix + command]
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        if args.malloc_mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
        with tempfile.TemporaryFile("w+") as out:
            code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
            out.seek(0)
            text = out.read()
        ranks = sorted((json.loads(line.split("RANK ", 1)[1]) for line in text.splitlines() if "RANK {" in line),
                       key=lambda r: r["rank"])
        for r, group in zip(ranks, groups):
            r["cgroup_peak_bytes"] = int(group[1].read_text()) if group[1].exists() else None
        return {"contender": contender, "fits": code == 0 and len(ranks) == args.np, "exit_code": code,
                "ranks": ranks, "tail": "" if code == 0 else text[-1500:]}
    finally:
        for _, _, path in groups:
            try:
                path.rmdir()
            except OSError:
                pass


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The transformer block stack's options (``--width --depth --heads --batch --seq``), as these benchmarks
    default them: 101M parameters (``benchmarks/sharded_step.py`` uses them too)."""
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="sequences (resnet50: images) per rank")
    p.add_argument("--seq", type=int, default=32)


def parse_contender_arguments(p: argparse.ArgumentParser, contenders: tuple) -> argparse.Namespace:
    """The arguments, with the worker's own (``--worker --contender``); ``--contenders`` checked (the driver's)."""
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--contender", choices=contenders, help=argparse.SUPPRESS)
    args = p.parse_args()
    unknown = set(args.contenders.split(",")) - set(contenders)
    if unknown and not args.worker:
        p.error(f"--contenders: unknown {sorted(unknown)}; choose from {', '.join(contenders)}")
    return args


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks")
    p.add_argument("--cap-mib", type=int, default=0, help="memory cap per rank in MiB (0: uncapped)")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated, from " + ", ".join(CONTENDERS))
    add_model_arguments(p)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one untimed)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per contender's job")
    p.add_argument("--tier", choices=("host", "disk"), default="host",
                   help="where the sharded contenders keep Adam's state (disk: a scratch file under --tier-dir)")
    p.add_argument("--tier-dir", default=os.path.join(tempfile.gettempdir(), "hvps-state-tier"),
                   help="the disk tier's directory (each rank uses rank<r> under it)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=131072,
                   help="the ranks' MALLOC_MMAP_THRESHOLD_ (0: glibc's own, which rises after each large free "
                        "up to 32 MiB, so freed gradient buckets stay in the heap and the peak RSS grows)")
    p.add_argument("--phases", action="store_true", help="record RSS after forward, backward and step")
    args = parse_contender_arguments(p, CONTENDERS)
    if args.worker:
        worker(args)
        return
    results = [run_contender(args, c) for c in args.contenders.split(",")]
    print(json.dumps({"np": args.np, "cap_mib": args.cap_mib, "tier": args.tier,
                      "malloc_mmap_threshold": args.malloc_mmap_threshold, "width": args.width,
                      "depth": args.depth,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
