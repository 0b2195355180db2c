"""What the authenticated control plane costs.

    python benchmarks/control_cost.py hmac            # per-message seal+open vs plain JSON framing
    mpirun -np 3 python benchmarks/control_cost.py startup [runs]   # hvps.init() time, rank 0 prints

The HMAC share of a ResNet-50 step is (extra time per message) x (messages per step) /
(step time); a step announces and answers at most one message per tensor (161).
"""

import json
import statistics
import sys
import time


def _request_message(tensors: int) -> dict:
    return {"requests": [{"name": f"allreduce.grad.layer{i}.weight", "kind": "allreduce", "dtype": "float32",
                          "shapes": [[256, 256, 3, 3]], "op": "average", "root": -1, "prescale": 1.0,
                          "postscale": 1.0, "splits": [], "device": "cpu", "process_set": 0}
                         for i in range(tensors)]}


def hmac_cost(repeats: int = 5, n: int = 2000) -> None:
    from hvps.control.wire import Session, encode, frame

    for tensors in (1, 16, 161):
        message = _request_message(tensors)
        plain, sealed = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(n):
                json.loads(frame(encode(message))[4:])
            plain.append((time.perf_counter() - start) / n)
            a, b = Session(b"k" * 32, b"a", b"b"), Session(b"k" * 32, b"b", b"a")
            start = time.perf_counter()
            for _ in range(n):
                b.open(a.seal(message)[4:], frozenset({"requests"}))
            sealed.append((time.perf_counter() - start) / n)
        p, s = statistics.median(plain) * 1e6, statistics.median(sealed) * 1e6
        print(f"{tensors:>4} requests/message ({len(encode(message))} B): plain {p:.1f} us, "
              f"authenticated {s:.1f} us, extra {s - p:.1f} us")


def startup(runs: int = 5) -> None:
    import hvps

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        hvps.init()
        times.append(time.perf_counter() - start)
        rank = hvps.rank()
        hvps.shutdown()
    if rank == 0:
        print(f"hvps.init(): "
              f"median {statistics.median(times) * 1e3:.1f} ms of {runs} ({', '.join(f'{t * 1e3:.0f}' for t in times)})")


if __name__ == "__main__":
    if sys.argv[1] == "hmac":
        hmac_cost()
    else:
        startup(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
