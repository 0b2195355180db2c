"""The sealed data plane's cost (HVPS_ENCRYPT=1): 64 MiB allreduce across 2 emulated hosts, sealed and
in clear, side by side in one run (``benchmarks/multihost.py``'s testbed and jobs, A B A B), and the
seal/open throughput of one core against ``openssl speed -evp aes-256-gcm`` on this machine.

    python benchmarks/encryption.py --rates 1gbit,10gbit --json out/encryption.json   # as root

Reports, per link rate, each implementation's median time, the encrypted/unencrypted throughput
ratio (against the faster of hvps's unsealed algorithms), and the CPU cost in cycles per byte.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import multihost  # noqa: E402

MiB = 1 << 20


def cpu_hz() -> float:
    """The nominal clock of this CPU (``cpu MHz`` of /proc/cpuinfo), for cycles per byte."""
    text = Path("/proc/cpuinfo").read_text()
    return float(re.search(r"cpu MHz\s*:\s*([\d.]+)", text).group(1)) * 1e6


def seal_rates(chunk: int = 4 * MiB, seconds: float = 1.0) -> dict:
    """Bytes/s one core seals and opens with ``cryptography``'s AES-256-GCM, as the data plane does."""
    import numpy as np

    from hvps.dataplane import sealed_crypto

    direction = sealed_crypto.Direction(os.urandom(32), 0, 1)
    plain = np.frombuffer(os.urandom(chunk), np.uint8)
    sealed = np.empty(chunk + sealed_crypto.TAG, np.uint8)
    out = np.empty(chunk, np.uint8)
    aad = sealed_crypto.aad(1, 1, 1, 0, chunk)
    rates = {}
    for what in ("seal", "open"):
        n, start = 0, time.perf_counter()
        nonce = direction.next_nonce()
        direction.seal_into(nonce, plain, sealed, aad)
        while time.perf_counter() - start < seconds:
            if what == "seal":
                direction.seal_into(nonce, plain, sealed, aad)
            else:
                direction.open_into(nonce, sealed, out, aad)
            n += 1
        rates[what] = n * chunk / (time.perf_counter() - start)
    return rates


def openssl_rate(block: int = 16384) -> float:
    """``openssl speed -evp aes-256-gcm`` at ``block`` bytes, one core, in bytes/s (0 when unavailable)."""
    try:
        out = subprocess.run(["openssl", "speed", "-seconds", "2", "-bytes", str(block), "-evp", "aes-256-gcm"],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0.0
    match = re.search(r"^AES-256-GCM\s+([\d.]+)k", out, re.M | re.I)
    return float(match.group(1)) * 1000 if match else 0.0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit,10gbit", help="link rates to run (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    hz = cpu_hz()
    rates = seal_rates()
    reference = openssl_rate()
    report = {"cpu_hz": hz, "seal_bytes_per_s": rates["seal"], "open_bytes_per_s": rates["open"],
              "openssl_16k_bytes_per_s": reference, "links": {}}
    print(f"one core, 4 MiB chunks: seal {rates['seal'] / 1e9:.2f} GB/s ({hz / rates['seal']:.2f} cycles/byte), "
          f"open {rates['open'] / 1e9:.2f} GB/s ({hz / rates['open']:.2f} cycles/byte); "
          f"openssl speed -evp aes-256-gcm at 16 KiB: {reference / 1e9:.2f} GB/s")
    for rate in args.rates.split(","):
        link = multihost.driver(multihost.main_args(["--rate", rate, "--impls", "hvps-mpi,hvps-ring,hvps-enc",
                                                     "--rounds", str(args.rounds), "--iters", str(args.iters)]))
        clear = min(link["impls"]["hvps-mpi"]["time_s"], link["impls"]["hvps-ring"]["time_s"])
        sealed = link["impls"]["hvps-enc"]["time_s"]
        # per rank and call: seal every byte sent to, open every byte received from the other host
        crypto_cycles = hz * (64 * MiB / rates["seal"] + 64 * MiB / rates["open"])
        link["encrypted_over_unencrypted_throughput"] = clear / sealed
        link["crypto_cycles_per_byte_moved"] = crypto_cycles / (2 * 64 * MiB)
        print(f"{rate}: encrypted throughput {clear / sealed:.3f}x unencrypted (best unsealed {clear * 1e3:.1f} ms, "
              f"sealed {sealed * 1e3:.1f} ms)")
        report["links"][rate] = link
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
