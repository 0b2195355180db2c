"""64 MiB allreduce across 2 emulated hosts (network namespaces, jobs/testbed) vs the link's TCP rate.

Driver (default, as root)::

    python benchmarks/multihost.py --rate 1gbit --json out/multihost.json

brings up a 2-host testbed with a tc tbf rate limit, measures the link's TCP
throughput with a plain socket sender/receiver between the two namespaces, then,
alternating A B A B for --rounds rounds, runs one mpirun job per implementation
(raw mpi4py ``Allreduce``, hvps with the mpi and ring algorithms), 1 rank per host,
TCP only. busbw = bytes * 2(n-1)/n / time (the slowest rank's time per call, calls
separated by a barrier, ``MPI.Wtime``); target: hvps busbw >= 85% of the TCP rate. "CPU ms": the
process CPU time (all threads) of the median call on its busiest rank.

Worker mode (``--impl``, under mpirun) times one implementation; rank 0 prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.common import MPIRUN_HELP, resolve_mpirun  # noqa: E402

TESTBED = REPO / "jobs" / "testbed" / "netns-cluster.sh"
MiB = 1 << 20


def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    n = args.bytes // 4
    send = np.ones(n, dtype=np.float32)
    recv = np.empty_like(send)
    if args.impl.startswith("hvps"):
        import hvps

        hvps.init()

        def call(i):
            hvps.allreduce(send, op=hvps.Sum, name=f"b{i}", out=recv) if _has_out() else \
                hvps.allreduce(send, op=hvps.Sum, name=f"b{i}")
    else:
        def call(i):
            comm.Allreduce(send, recv, op=MPI.SUM)
    times, cpus = [], []
    for i in range(args.warmup + args.iters):
        comm.Barrier()
        t0, c0 = MPI.Wtime(), time.process_time()
        call(i)
        dt, cpu = MPI.Wtime() - t0, time.process_time() - c0
        dt, cpu = comm.allreduce(dt, op=MPI.MAX), comm.allreduce(cpu, op=MPI.MAX)  # each: the slowest rank's
        if i >= args.warmup:
            times.append(dt)
            cpus.append(cpu)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"impl": args.impl, "times": times, "cpu": cpus}), flush=True)


def _has_out() -> bool:
    import inspect

    import hvps

    return "out" in inspect.signature(hvps.allreduce).parameters


def testbed(action: str, env: dict) -> str:
    return subprocess.run(["bash", str(TESTBED), action], env=env, capture_output=True, text=True,
                          check=True).stdout


def tcp_throughput(ns_send: str, ns_recv: str, addr: str, nbytes: int) -> float:
    """Bytes/s of one TCP stream from ns_send to ns_recv (receiver-side timing)."""
    port = 47123
    recv_code = (
        "import socket, time\n"
        f"s = socket.create_server(('{addr}', {port})); c, _ = s.accept(); n = 0; buf = bytearray(1 << 20)\n"
        "t0 = None\n"
        "while True:\n"
        "    k = c.recv_into(buf)\n"
        "    if not k: break\n"
        "    t0 = t0 or time.perf_counter(); n += k\n"
        "print(n / (time.perf_counter() - t0))\n")
    send_code = (
        "import socket, time\n"
        "for _ in range(100):\n"
        "    try:\n"
        f"        c = socket.create_connection(('{addr}', {port})); break\n"
        "    except ConnectionRefusedError: time.sleep(0.05)\n"
        f"block = b'x' * (1 << 20)\n"
        f"for _ in range({nbytes // MiB}): c.sendall(block)\n"
        "c.close()\n")
    rx = subprocess.Popen(["ip", "netns", "exec", ns_recv, sys.executable, "-c", recv_code], stdout=subprocess.PIPE,
                          text=True)
    subprocess.run(["ip", "netns", "exec", ns_send, sys.executable, "-c", send_code], check=True, timeout=300)
    out, _ = rx.communicate(timeout=60)
    return float(out.strip())


def driver(args) -> dict:
    if os.geteuid() != 0:
        sys.exit("multihost.py: needs root for network namespaces")
    prefix = f"hvb{os.getpid() % 100000}"
    env = dict(os.environ, TB_HOSTS="2", TB_PREFIX=prefix, TB_SUBNET=args.subnet, TB_RATE=args.rate,
               TB_STATE=f"/run/hvps-testbed/{prefix}")
    state = Path(env["TB_STATE"])
    testbed("up", env)
    try:
        tcp = [tcp_throughput(f"{prefix}-h0", f"{prefix}-h1", f"{args.subnet}.2", args.tcp_bytes)
               for _ in range(args.rounds)]
        mpi_args = (state / "mpirun-args").read_text().split()
        results: dict = {impl: [] for impl in args.impls.split(",")}
        cpu: dict = {impl: [] for impl in results}  # the median call's process CPU time on its busiest rank
        for _ in range(args.rounds):
            for impl in results:
                run_env = dict(os.environ, PYTHONPATH=str(REPO),
                               HVPS_ALLREDUCE_ALGORITHM="ring" if impl == "hvps-ring" else "mpi",
                               HVPS_ENCRYPT="1" if impl == "hvps-enc" else "0")  # benchmarks/encryption.py
                cmd = [resolve_mpirun(args.mpirun), "-np", "2", "--allow-run-as-root",
                       "--hostfile", str(state / "hostfile"),
                       "--bind-to", "none", "--map-by", "slot", "-x", "PYTHONPATH", "-x", "HVPS_ALLREDUCE_ALGORITHM",
                       "-x", "HVPS_ENCRYPT",
                       *mpi_args, sys.executable, __file__, "--impl", impl, "--bytes", str(args.bytes),
                       "--iters", str(args.iters), "--warmup", str(args.warmup)]
                proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=600)
                line = next((ln for ln in proc.stdout.splitlines() if "RESULT " in ln), None)
                if proc.returncode != 0 or line is None:
                    raise RuntimeError(f"{impl} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
                result = json.loads(line.split("RESULT ", 1)[1])
                results[impl].append(statistics.median(result["times"]))
                cpu[impl].append(statistics.median(result["cpu"]))
    finally:
        testbed("down", env)
    tcp_rate = statistics.median(tcp)
    busbw_factor = 2 * (2 - 1) / 2
    report = {"rate": args.rate, "bytes": args.bytes, "tcp_bytes_per_s": tcp_rate, "tcp_runs": tcp, "impls": {}}
    print(f"link {args.rate}: TCP throughput {tcp_rate / 1e6:.1f} MB/s (median of {len(tcp)})")
    print(f"{'impl':<10} {'time ms':>9} {'busbw MB/s':>11} {'of TCP':>7} {'CPU ms':>7}")
    for impl, times in results.items():
        t, cpu_s = statistics.median(times), statistics.median(cpu[impl])
        busbw = args.bytes * busbw_factor / t
        report["impls"][impl] = {"time_s": t, "rounds": times, "busbw_bytes_per_s": busbw,
                                 "fraction_of_tcp": busbw / tcp_rate, "cpu_s": cpu_s, "cpu_rounds": cpu[impl]}
        print(f"{impl:<10} {t * 1e3:9.1f} {busbw / 1e6:11.1f} {busbw / tcp_rate:7.1%} {cpu_s * 1e3:7.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def main_args(argv=None) -> argparse.Namespace:
    """The parsed command line (``benchmarks/encryption.py`` builds the driver's from it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", help="worker mode: raw | hvps-mpi | hvps-ring | hvps-enc (HVPS_ENCRYPT=1) (under mpirun)")
    p.add_argument("--impls", default="raw,hvps-mpi,hvps-ring", help="driver: implementations (default: %(default)s)")
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of each host's link (default: %(default)s)")
    p.add_argument("--subnet", default="198.18.250", help="testbed /24 in 198.18.0.0/15 (default: %(default)s)")
    p.add_argument("--bytes", type=int, default=64 * MiB, help="allreduce size (default: 64 MiB)")
    p.add_argument("--tcp-bytes", type=int, default=256 * MiB, help="bytes per TCP measurement (default: 256 MiB)")
    p.add_argument("--iters", type=int, default=5, help="timed calls per job (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per job (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="driver: A B A B rounds (default: %(default)s)")
    p.add_argument("--mpirun", default=None, help=MPIRUN_HELP)
    p.add_argument("--json", default="", help="driver: write results here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = main_args(argv)
    if args.impl:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
