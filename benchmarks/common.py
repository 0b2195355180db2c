"""Helpers shared by the hvps benchmarks: statistics, JSON output, rank-0 logging,
MPI waits that do not spin, and launching worker processes under ``mpirun``.

Only the standard library and numpy are needed here (no scipy): the Student t
quantile is computed from the closed-form t CDF for integer degrees of freedom.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # lets ``import hvps`` work before ``pip install -e .``
    sys.path.insert(0, str(REPO_ROOT))

MiB = 1 << 20

# Horovod's recommended mpirun flags (no core binding, so intra-op and
# background threads of a rank are free to use the cores given to it).
DEFAULT_MPIRUN_ARGS = "--bind-to none --map-by slot"


# ----------------------------------------------------------------------------- statistics
def _t_cdf(t: float, df: int) -> float:
    """CDF of Student's t for integer ``df`` (Abramowitz & Stegun 26.7.3/26.7.4)."""
    theta = math.atan(abs(t) / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 1:
        term, acc = 1.0, 1.0
        for k in range(1, (df - 1) // 2):  # 1 + 2/3 c^2 + 2*4/(3*5) c^4 + ...
            term *= c2 * (2 * k) / (2 * k + 1)
            acc += term
        a = (2 / math.pi) * (theta + (s * math.cos(theta) * acc if df > 1 else 0.0))
    else:
        term, acc = 1.0, 1.0
        for k in range(1, df // 2):  # 1 + 1/2 c^2 + 1*3/(2*4) c^4 + ...
            term *= c2 * (2 * k - 1) / (2 * k)
            acc += term
        a = s * acc
    return 0.5 + math.copysign(a / 2, t)


def t_quantile(p: float, df: int) -> float:
    """Quantile ``p`` (0.5 < p < 1) of Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        return math.nan
    df = min(df, 1000)  # the t law is the normal law to 4 digits beyond this
    lo, hi = 0.0, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def summarize(samples: Iterable[float], confidence: float = 0.95) -> dict[str, Any]:
    """Mean, median, stdev and the two-sided t confidence interval of the mean
    (CI bounds are None for a single sample)."""
    xs = [float(x) for x in samples]
    n = len(xs)
    if n == 0:
        return {"n": 0}
    mean = statistics.fmean(xs)
    std = statistics.stdev(xs) if n > 1 else 0.0
    half = t_quantile(0.5 + confidence / 2, n - 1) * std / math.sqrt(n) if n > 1 else None
    return {"n": n, "mean": mean, "median": statistics.median(xs), "std": std,
            "min": min(xs), "max": max(xs),
            "ci_low": None if half is None else mean - half,
            "ci_high": None if half is None else mean + half,
            "ci_half_width": half, "confidence": confidence}


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(xs))


# ----------------------------------------------------------------------------- output
def write_json(path: str | os.PathLike | None, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` (no-op when ``path`` is falsy)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=float) + "\n")


def log0(rank: int, *args: Any) -> None:
    """Print (flushed) from rank 0 only."""
    if rank == 0:
        print(*args, flush=True)


def fmt_bytes(n: int) -> str:
    """Human-readable power-of-two size: 4 KiB, 64 MiB, ..."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """Parse '4096', '4K', '4KiB', '64M', '64MiB', '1G' into bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if scale > 1 else t) * scale)


# ----------------------------------------------------------------------------- MPI helpers
def idle_barrier(comm: Any, poll_s: float = 0.02) -> None:
    """Barrier that sleeps instead of busy-polling, so a waiting rank leaves its
    core to the ranks still working (Open MPI's ``Barrier`` spins)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def torch_default_group(comm: Any, device: str = "cpu") -> None:
    """torch.distributed's default group, bootstrapped over MPI as hvps's tdist backend is; destroyed at exit
    (gloo's threads left running abort the interpreter's exit: "terminate called without an active exception")."""
    import atexit
    import socket

    import torch
    import torch.distributed as dist

    address = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    if device == "cuda":
        torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=comm.bcast(address),
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    atexit.register(dist.destroy_process_group)


MPIRUN_HELP = "mpirun executable (default: the one hvpsrun finds: $HVPS_MPIRUN, beside this Python, then PATH)"


def resolve_mpirun(mpirun: str | None) -> str:
    """The mpirun to launch workers with, by hvpsrun's rule (``--mpirun``, ``$HVPS_MPIRUN``,
    the running Python's directory, PATH)."""
    from hvps.runner.mpi_discovery import find_mpirun

    return find_mpirun(mpirun).path


def mpirun_command(np_: int, argv: Sequence[str], mpirun: str | None = None,
                   mpirun_args: str = DEFAULT_MPIRUN_ARGS,
                   env_vars: Sequence[str] = ()) -> list[str]:
    """``mpirun -np N [flags] [-x VAR ...] argv``; adds Open MPI's root and
    oversubscribe flags when they apply. ``mpirun="none"`` runs one process
    without a launcher (an MPI singleton)."""
    if mpirun == "none":
        if np_ != 1:
            raise ValueError(f"--mpirun none runs a single process; got -np {np_}")
        return list(argv)
    cmd = [resolve_mpirun(mpirun), "-np", str(np_)]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd.append("--oversubscribe")
    cmd += shlex.split(mpirun_args)
    for var in env_vars:
        cmd += ["-x", var]
    return cmd + list(argv)


def run_mpi_worker(np_: int, script: str | os.PathLike, args: Sequence[str],
                   env: dict[str, str] | None = None, mpirun: str | None = None,
                   mpirun_args: str = DEFAULT_MPIRUN_ARGS, timeout: float | None = None,
                   verbose: bool = False) -> Any:
    """Launch ``mpirun -np N python script args --json TMP`` and return the JSON
    that rank 0 wrote to TMP. Raises ``RuntimeError`` with the output tail on failure."""
    extra_env = dict(env or {})
    extra_env.setdefault("PYTHONPATH", os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p))
    full_env = {**os.environ, **extra_env}
    with tempfile.TemporaryDirectory(prefix="hvps-bench-") as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, str(script), *args, "--json", str(out)]
        cmd = mpirun_command(np_, argv, mpirun, mpirun_args, sorted(extra_env))
        if verbose:
            print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"worker failed (rc={proc.returncode}): {' '.join(cmd)}\n{tail}")
        return json.loads(out.read_text())


class Progress:
    """Rank-0 reporting for the training harnesses: ``tick`` per timed iteration, ``log`` for lines.

    With ``bar`` a tqdm progress bar (iterations done out of ``total``), else one line per tick.
    """

    def __init__(self, total: int, rank: int, bar: bool) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.rank, self.use_bar, self.done = rank, bar, 0
        self.bar = tqdm(total=total, disable=not (bar and rank == 0), unit="iter", file=sys.stderr)

    def tick(self, msg: str) -> None:
        self.done += 1
        self.bar.update(1)
        if self.use_bar:
            self.bar.set_postfix_str(msg)
        elif self.rank == 0:
            print(f"Iter #{self.done}: {msg}", flush=True)

    def log(self, *args: Any) -> None:
        if self.rank == 0:
            (self._tqdm.write if self.use_bar else print)(" ".join(str(a) for a in args))
            sys.stdout.flush()

    def close(self) -> None:
        self.bar.close()


def dispatch(argv: list[str] | None, parse_args: Callable, run_worker: Callable, run_driver: Callable):
    """Entry point of a benchmark that launches its own ranks: with ``--impl`` this process is one
    rank of that contender (``run_worker``); without, it is the driver that launches the contenders
    and compares them (``run_driver``)."""
    args = parse_args(argv)
    return run_worker(args) if args.impl else run_driver(args)
