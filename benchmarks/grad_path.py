"""Gradient-path benchmark (issue 23 §3): the training thread's Python time per gradient tensor,
from the backward hook to ``Engine.submit_all``, on ResNet-50's 161 gradients.

Each rank trains ResNet-50 (synthetic data, SGD) under ``hvd.DistributedOptimizer``. Every
post-accumulate-grad hook the optimizer registers is wrapped in ``time.perf_counter`` calls,
and the engine's ``submit_all`` is wrapped too, so that per backward pass the job records:

* ``hook_us``:        the training thread's CPU time (``time.thread_time``) inside the hooks,
                      per gradient: what it pays while backward runs, ``submit_all`` included
* ``hook_wall_us``:   the same in wall-clock time (``perf_counter``): adds waits for the GIL,
                      the engine's lock and the CPU (noisy on a shared machine)
* ``submit_wall_us``: of which inside ``Engine.submit_all`` (wall clock), per gradient
* ``finish_us``:      CPU time of ``synchronize()`` once every collective has completed, per
                      gradient (the finishers: casts back, installs, the handles' bookkeeping)
* ``frames``:       Python frames from the hook to ``Engine.submit_all``, both included
* ``calls``:        Python function calls per hook (one profiled pass, ``sys.setprofile``)

Per job the median over the timed passes counts (each pass: the slowest rank), per tree the
median over rounds. With ``--before DIR`` the driver alternates jobs of that tree (a
``git worktree`` of the baseline commit) with jobs of this checkout and prints both.

    git worktree add /tmp/hvps-before a5996fb
    python benchmarks/grad_path.py --np 1,2 --before /tmp/hvps-before --json out/grad_path.json
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import platform
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.common import DEFAULT_MPIRUN_ARGS, MPIRUN_HELP, dispatch, median, run_mpi_worker, write_json  # noqa: E402

METRICS = ("hook_us", "hook_wall_us", "submit_wall_us", "finish_us")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("worker",), help="worker mode (internal): time one job (run under mpirun)")
    p.add_argument("--tree", default="",
                   help="worker: import hvps and hvps.adapters from this source tree instead of this checkout")
    p.add_argument("--np", default="1,2", help="driver: comma list of world sizes, one job each per round "
                   "(default: %(default)s)")
    p.add_argument("--before", default="",
                   help="driver: a baseline source tree (e.g. a git worktree of a5996fb); its jobs alternate "
                   "with this checkout's and both are reported")
    p.add_argument("--rounds", type=int, default=3,
                   help="driver: rounds of alternating jobs; medians over rounds (default: %(default)s)")
    p.add_argument("--iters", type=int, default=8, help="timed backward passes per job (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed passes per job first (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=2, help="images per rank per pass (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=32,
                   help="synthetic image height and width in pixels; the hooks' cost does not depend on it "
                   "(default: %(default)s)")
    p.add_argument("--compression", choices=("none", "fp16", "bf16"), default="none",
                   help="DistributedOptimizer compression= (default: %(default)s)")
    p.add_argument("--threads-per-rank", type=int, default=1,
                   help="torch intra-op threads per rank (default: %(default)s)")
    p.add_argument("--mpirun", default=None, help="driver: " + MPIRUN_HELP)
    p.add_argument("--mpirun-args", default=DEFAULT_MPIRUN_ARGS,
                   help="driver: extra mpirun flags (default: '%(default)s')")
    p.add_argument("--timeout", type=float, default=900, help="driver: seconds allowed per job (default: %(default)s)")
    p.add_argument("--json", default="", help="write results as JSON to this path (driver: every job's values, "
                   "the command line and host facts; worker: rank 0's job result)")
    p.add_argument("--verbose", action="store_true", help="driver: echo each mpirun command")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- worker
class _AdaptersFrom(importlib.abc.MetaPathFinder):
    """Finds ``hvps.adapters`` in ``root``/adapters: a tree from before the adapters moved into hvps/adapters/
    (setup.cfg's ``package_dir`` mapped them)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, "adapters")

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "hvps.adapters":
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [os.path.dirname(self.path)])


def _import_tree(tree: str):
    """``hvps.adapters.torch`` from ``tree`` (or this checkout); checks where it came from."""
    root = os.path.realpath(tree or str(REPO_ROOT))
    if tree:
        sys.path.insert(0, root)
        if os.path.isdir(os.path.join(root, "adapters")):
            sys.meta_path.insert(0, _AdaptersFrom(root))
    import hvps
    import hvps.adapters.torch as hvd

    for module in (hvps, hvd):
        if not os.path.realpath(module.__file__).startswith(root + os.sep):
            raise SystemExit(f"{module.__name__} was imported from {module.__file__}, not from {root}")
    return hvd, root


class _Probe:
    """Times the optimizer's gradient hooks and the engine's ``submit_all`` calls inside them."""

    def __init__(self) -> None:
        self.hook_s: list[float] = []
        self.hook_cpu_s: list[float] = []
        self.submit_s = 0.0
        self.frames: list[int] = []
        self.calls = 0
        self.profiling = False
        self._in_hook = False

    def wrap_hooks(self, torch) -> None:
        """Wrap every hook registered from now on (the optimizer registers one per parameter)."""
        register = torch.Tensor.register_post_accumulate_grad_hook
        probe = self

        def timed_register(tensor, hook):
            def timed(p):
                probe._in_hook = True
                if probe.profiling:
                    sys.setprofile(probe._count)
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    hook(p)
                finally:
                    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
                    sys.setprofile(None)
                    probe._in_hook = False
                probe.hook_s.append(elapsed)
                probe.hook_cpu_s.append(cpu)
            return register(tensor, timed)

        torch.Tensor.register_post_accumulate_grad_hook = timed_register

    def _count(self, frame, event, arg) -> None:
        if event == "call":
            self.calls += 1

    def wrap_submit(self, engine) -> None:
        submit_all = engine.submit_all
        probe = self

        def timed_submit_all(entries):
            if not probe._in_hook:
                return submit_all(entries)
            frame, depth = sys._getframe(1), 1  # 1: submit_all itself
            while frame is not None and frame.f_code.co_name != "timed":
                depth += 1
                frame = frame.f_back
            probe.frames.append(depth)
            t0 = time.perf_counter()
            try:
                return submit_all(entries)
            finally:
                probe.submit_s += time.perf_counter() - t0

        engine.submit_all = timed_submit_all


def run_worker(args: argparse.Namespace) -> None:
    """One job: ``warmup + iters`` timed passes; rank 0 writes the per-pass values (slowest rank)."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from benchmarks.resnet import resnet50

    torch.set_num_threads(args.threads_per_rank)
    hvd, root = _import_tree(args.tree)
    from hvps.runtime import state as runtime

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(1234)
    model = resnet50()
    probe = _Probe()
    probe.wrap_hooks(torch)
    probe.wrap_submit(runtime.engine())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=getattr(hvd.Compression, args.compression))
    gen = torch.Generator().manual_seed(rank)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    target = torch.randint(0, 1000, (args.batch_size,), generator=gen)

    def one_pass(profile: bool = False) -> list:
        opt.zero_grad()
        loss = F.cross_entropy(model(data), target)
        comm.Barrier()
        probe.hook_s, probe.hook_cpu_s, probe.submit_s, probe.frames, probe.profiling = [], [], 0.0, [], profile
        loss.backward()
        hooks, cpu, submit, frames = list(probe.hook_s), list(probe.hook_cpu_s), probe.submit_s, list(probe.frames)
        while not all(h is None or h.poll() for h in opt._handles.values()):
            time.sleep(0.0005)
        c0 = time.thread_time()
        opt.synchronize()
        finish = time.thread_time() - c0
        with opt.skip_synchronize():
            opt.step()
        n = max(len(hooks), 1)
        return [sum(cpu) / n * 1e6, sum(hooks) / n * 1e6, submit / n * 1e6, finish / n * 1e6,
                len(hooks), max(frames, default=0), min(frames, default=0), float(np.median(cpu)) * 1e6]

    for _ in range(args.warmup):
        one_pass()
    rows = np.array([one_pass() for _ in range(args.iters)])
    probe.calls = 0
    counted = one_pass(profile=True)
    calls = probe.calls / max(counted[4], 1)
    slowest = np.empty_like(rows) if rank == 0 else None
    comm.Reduce(rows, slowest, op=MPI.MAX, root=0)
    if rank == 0:
        med = np.median(slowest, axis=0)
        write_json(args.json, {
            "tree": root, "hvps_file": sys.modules["hvps"].__file__, "ranks": size, "compression": args.compression,
            "gradients": int(med[4]), "frames_max": int(slowest[:, 5].max()), "frames_min": int(rows[:, 6].min()),
            "calls_per_hook": calls, "median_hook_us": float(med[7]),
            **{name: float(med[i]) for i, name in enumerate(METRICS)},
            "per_pass": {name: slowest[:, i].tolist() for i, name in enumerate(METRICS)},
        })
    hvd.shutdown()


# ----------------------------------------------------------------------------- driver
def _host_facts() -> dict:
    import torch

    return {"hostname": platform.node(), "nproc": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def run_driver(args: argparse.Namespace) -> dict:
    """Alternate before/after jobs per world size over rounds; report medians and after/before ratios."""
    sizes = [int(n) for n in args.np.split(",") if n.strip()]
    trees = {"before": os.path.realpath(args.before)} if args.before else {}
    trees["after"] = ""
    common = ["--impl", "worker", "--iters", str(args.iters), "--warmup", str(args.warmup),
              "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
              "--compression", args.compression, "--threads-per-rank", str(args.threads_per_rank)]
    jobs: dict = {str(n): {label: [] for label in trees} for n in sizes}
    host = _host_facts()
    for rnd in range(args.rounds):
        for n in sizes:
            for label, tree in trees.items():
                res = run_mpi_worker(n, __file__, [*common, *(["--tree", tree] if tree else [])],
                                     mpirun=args.mpirun, mpirun_args=args.mpirun_args, timeout=args.timeout,
                                     verbose=args.verbose)
                jobs[str(n)][label].append(res)
                print(f"round {rnd + 1}/{args.rounds} np {n} {label:<6}: hook {res['hook_us']:.1f} us/grad CPU "
                      f"({res['hook_wall_us']:.1f} wall, submit_all {res['submit_wall_us']:.1f}), "
                      f"finish {res['finish_us']:.1f} us/grad, "
                      f"{res['frames_max']} frames, {res['calls_per_hook']:.0f} calls/hook", flush=True)
    summary: dict = {}
    for n in sizes:
        entry = {}
        for label in trees:
            runs = jobs[str(n)][label]
            entry[label] = {m: median([r[m] for r in runs]) for m in (*METRICS, "median_hook_us")}
            entry[label].update(frames=max(r["frames_max"] for r in runs),
                                calls_per_hook=median([r["calls_per_hook"] for r in runs]),
                                gradients=runs[0]["gradients"])
        if "before" in entry:
            entry["after_over_before"] = {m: entry["after"][m] / entry["before"][m] for m in METRICS
                                          if entry["before"][m] > 0}
        summary[str(n)] = entry
    result = {"benchmark": "grad_path", "command": [sys.executable, *sys.argv], "trees": trees, "rounds": args.rounds,
              "iters": args.iters, "warmup": args.warmup, "batch_size": args.batch_size,
              "image_size": args.image_size, "compression": args.compression, "host": host,
              "loadavg_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
              "summary": summary, "jobs": jobs}
    print(f"\n# gradient path: ResNet-50 ({summary[str(sizes[0])]['after']['gradients']} gradients), compression "
          f"{args.compression}, medians over {args.rounds} round(s) of {args.iters} passes, nproc {host['nproc']}")
    print("us per gradient; hook and finish: CPU time of the training thread; wall: perf_counter")
    print(f"{'np':<4}{'tree':<8}{'hook':>9}{'wall':>8}{'submit':>8}{'finish':>8}{'frames':>8}{'calls':>7}")
    for n in sizes:
        for label in trees:
            e = summary[str(n)][label]
            print(f"{n:<4}{label:<8}{e['hook_us']:9.1f}{e['hook_wall_us']:8.1f}{e['submit_wall_us']:8.1f}"
                  f"{e['finish_us']:8.1f}{e['frames']:8d}{e['calls_per_hook']:7.0f}")
        if "after_over_before" in summary[str(n)]:
            ratio = summary[str(n)]["after_over_before"]
            print(f"{n:<4}{'ratio':<8}" + "".join(f"{ratio.get(m, float('nan')):{w}.2f}"
                                                  for m, w in zip(METRICS, (9, 8, 8, 8))))
    write_json(args.json, result)
    return result


def main(argv: list[str] | None = None):
    return dispatch(argv, parse_args, run_worker, run_driver)


if __name__ == "__main__":
    main()
