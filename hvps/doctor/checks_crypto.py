"""Whether this CPU can seal the data plane at line rate (``HVPS_ENCRYPT``): AES-NI, and one core's
measured AES-256-GCM throughput through the same ``cryptography`` calls the data plane makes."""
from __future__ import annotations

import os
import time

from .base import Check, Context, check
from .host import Host

#: one core below this seals slower than a 10 Gbit/s link moves bytes
SLOW_BYTES_PER_S = 1.25e9


def seal_rate(chunk: int = 1 << 20, seconds: float = 0.2):
    """Bytes/s one core seals with AES-256-GCM in ``chunk``-byte messages (None without cryptography)."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        return None

    aead, plain = AESGCM(os.urandom(32)), os.urandom(chunk)
    nonce, n, start = os.urandom(12), 0, time.perf_counter()
    while n == 0 or time.perf_counter() - start < seconds:
        aead.encrypt(nonce, plain, b"")
        n += 1
    return n * chunk / (time.perf_counter() - start)


@check("crypto.seal", "cpu")
def sealing(host: Host, ctx: Context) -> Check:
    why = ("HVPS_ENCRYPT=1 seals every byte that crosses hosts with AES-256-GCM: one core must seal and open "
           "faster than the link moves data, which takes AES-NI")
    flags = next((line for line in (host.read("/proc/cpuinfo") or "").splitlines() if line.startswith("flags")), "")
    aes = "aes" in flags.split()
    rate = host.fact("seal_bytes_per_s", seal_rate)
    if rate is None:
        return Check("crypto.seal", "skip", f"AES-NI {'yes' if aes else 'no'}; cryptography not installed",
                     why, "pip install 'hvps[encrypt]'", {"aes_ni": aes})
    value = f"AES-NI {'yes' if aes else 'no'}, seal {rate / 1e9:.2f} GB/s per core"
    data = {"aes_ni": aes, "seal_bytes_per_s": rate}
    if not aes or rate < SLOW_BYTES_PER_S:
        return Check("crypto.seal", "warn", value, why + f"; below {SLOW_BYTES_PER_S / 1e9:.2f} GB/s sealing slows "
                     "a 10 Gbit/s link", "use a CPU with AES-NI (flag 'aes' in /proc/cpuinfo) for encrypted jobs", data)
    return Check("crypto.seal", "ok", value, why, data=data)
