"""Training speed while hvps's metrics endpoint is attacked: idle, 200 clients, 1,000 slow-loris.

A "training" process serves its metrics with ``hvps.metrics.serve()`` (no ``hvps.init``: one
process, no MPI) and runs a tight torch step loop: a 3-layer MLP, forward, backward and SGD on
one thread (``torch.set_num_threads(1)``), opening a small file every step the way a data loader
would. Its soft ``RLIMIT_NOFILE`` is --nofile (1024, the usual default), so a server that holds a
file descriptor per connection makes that ``open()`` fail with EMFILE; failures are counted.

The driver alternates load phases of --phase-seconds each, in rounds (idle, clients, idle,
slowloris, ...), so that a drift in machine speed cancels:

- ``idle``: nobody connects but the driver's own scraper;
- ``clients``: --clients threads (in a separate process) each scrape in a loop, with the right
  basic-auth credentials (and, over TLS, a verified handshake), as fast as the server answers;
- ``slowloris``: --slowloris connections (a separate process, non-blocking sockets), opened at
  --slowloris-rate per second, that send their request one byte per --trickle-seconds (over TLS:
  the ClientHello, byte by byte) and are reopened at once when the server closes them.

Throughout, the driver scrapes once per --scrape-interval as Prometheus would and records each
scrape's latency and failures. Steps/s of a phase counts from --settle-seconds after its start;
its ratio is over the idle phase of the same round. The result (JSON, stdout and --json) gives,
per transport (http, tls) and load, the median over rounds of the ratio and of steps/s, the CPU
(in cores) of the training thread and of the process's other threads (the exporter: torch runs on
one thread), the process's peak open file descriptors and threads, EMFILE failures, and scrape
latencies. On a shared machine the wall-clock ratio scatters with the other work; the exporter's
CPU does not.

Run it against another tree (the code before a change) with --hvps-tree, e.g.
``git worktree add /tmp/before HEAD~1`` then ``--hvps-tree /tmp/before``.

    python benchmarks/metrics_load.py --rounds 3 --json results/metrics-load.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import resource
import selectors
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
USER, PASSWORD = "prometheus", "scrape-s3cret"
LOADS = ("idle", "clients", "slowloris")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default="http,tls",
                   help="comma-separated: http (plain, basic auth) and/or tls (HTTPS with a self-signed "
                        "certificate the clients verify, basic auth) (default: %(default)s)")
    p.add_argument("--loads", default=",".join(LOADS),
                   help="comma-separated phases of each round, an idle phase always first: idle, clients, "
                        "slowloris (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of phases per transport (default: %(default)s)")
    p.add_argument("--phase-seconds", type=float, default=6.0,
                   help="length of the idle and clients phases (default: %(default)s)")
    p.add_argument("--slowloris-seconds", type=float, default=20.0,
                   help="length of the slowloris phase: longer, because the connections ramp up at "
                        "--slowloris-rate (10 s for 1,000) (default: %(default)s)")
    p.add_argument("--settle-seconds", type=float, default=1.5,
                   help="start of each phase left out of its steps/s, while the load ramps up (default: %(default)s)")
    p.add_argument("--clients", type=int, default=200,
                   help="concurrent scraping clients in the clients phase (default: %(default)s)")
    p.add_argument("--slowloris", type=int, default=1000,
                   help="slow-loris connections held in the slowloris phase (default: %(default)s)")
    p.add_argument("--slowloris-rate", type=float, default=100.0,
                   help="slow-loris connections opened per second until --slowloris are open (an attacker ramps "
                        "up, so that the listen queue does not turn them away) (default: %(default)s)")
    p.add_argument("--trickle-seconds", type=float, default=1.0,
                   help="seconds between two bytes of one slow-loris connection (default: %(default)s)")
    p.add_argument("--scrape-interval", type=float, default=0.5,
                   help="seconds between the driver's own scrapes, which time a legitimate scrape "
                        "(default: %(default)s)")
    p.add_argument("--scrape-timeout", type=float, default=10.0,
                   help="a legitimate scrape slower than this counts as failed (default: %(default)s)")
    p.add_argument("--nofile", type=int, default=1024,
                   help="soft RLIMIT_NOFILE of the training process (default: %(default)s, the usual ulimit -n)")
    p.add_argument("--extra-fds", type=int, default=20,
                   help="descriptors the training process opens (/dev/null) and keeps, so that it holds about "
                        "what a rank of a 2-rank hvps job holds after init (24 measured; this process alone "
                        "holds ~5) (default: %(default)s)")
    p.add_argument("--width", type=int, default=256, help="width of the MLP's layers (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32, help="batch size of a training step (default: %(default)s)")
    p.add_argument("--hvps-tree", default=str(REPO),
                   help="source tree whose hvps the training process imports (PYTHONPATH); default: this "
                        "repository")
    p.add_argument("--json", default="", help="also write the result to this file")
    p.add_argument("--role", choices=("train", "clients", "slowloris"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cert", default="", help=argparse.SUPPRESS)
    p.add_argument("--key", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the training process ---------------------------------------------------------------------
def train(args: argparse.Namespace) -> None:
    """Serve metrics, then step until SIGTERM; write (time, steps) samples and resource peaks."""
    import torch

    from hvps import metrics

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.nofile, hard), hard))
    torch.set_num_threads(1)
    kept = [open(os.devnull, "rb") for _ in range(args.extra_fds)]  # noqa: SIM115 - held for the whole run
    exporter = metrics.serve(0, certfile=args.cert or None, keyfile=args.key or None,
                             basic_auth=(USER, PASSWORD))
    print(json.dumps({"url": exporter.url, "port": exporter.port}), flush=True)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.ReLU(), torch.nn.Linear(w, w), torch.nn.ReLU(),
                                torch.nn.Linear(w, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(args.batch, w), torch.randint(0, 10, (args.batch,))
    data = tempfile.NamedTemporaryFile(prefix="hvps-metrics-load-", delete=False)
    data.write(b"x" * 4096)
    data.close()

    samples, steps, emfile, peak_fds, peak_threads = [], 0, 0, 0, 0
    next_sample = time.monotonic()
    while not stop.is_set():
        try:
            with open(data.name, "rb") as f:  # the data loader's open(): EMFILE when fds run out
                f.read(64)
        except OSError:
            emfile += 1
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        metrics.record_samples(args.batch)
        steps += 1
        now = time.monotonic()
        if now >= next_sample:
            # the process's CPU time less the training thread's: the exporter's threads (torch: one thread)
            samples.append((now, steps, time.process_time(), time.thread_time()))
            next_sample = now + 0.1
            try:
                peak_fds = max(peak_fds, len(os.listdir("/proc/self/fd")))
            except OSError:  # EMFILE too: listing a folder opens it
                emfile += 1
                peak_fds = max(peak_fds, min(args.nofile, hard))
            peak_threads = max(peak_threads, threading.active_count())
    samples.append((time.monotonic(), steps, time.process_time(), time.thread_time()))
    os.unlink(data.name)
    exporter.close()
    for f in kept:
        f.close()
    Path(args.out).write_text(json.dumps({"samples": samples, "emfile": emfile, "peak_fds": peak_fds,
                                          "peak_threads": peak_threads}))


# -- load generators ------------------------------------------------------------------------
def _request() -> bytes:
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    return (f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic {token}\r\n"
            "Connection: close\r\n\r\n").encode()


def _client_context(cert: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


def scrape_once(port: int, cert: str, timeout: float) -> bool:
    """One full scrape with credentials; True when it returned 200 and a body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        deadline = time.monotonic() + timeout
        sock = _client_context(cert).wrap_socket(raw, server_hostname="127.0.0.1") if cert else raw
        sock.sendall(_request())
        chunks = []
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        reply = b"".join(chunks)
        return reply.startswith(b"HTTP/1.") and b" 200 " in reply[:16] and b"hvps_info" in reply


def clients(args: argparse.Namespace) -> None:
    """--clients threads scraping in a loop until SIGTERM; prints the counts."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    counts = {"ok": 0, "failed": 0}
    lock = threading.Lock()

    def loop() -> None:
        while not stop.is_set():
            try:
                ok = scrape_once(args.port, args.cert, 10.0)
            except (OSError, ssl.SSLError):
                ok = False
                time.sleep(0.01)
            with lock:
                counts["ok" if ok else "failed"] += 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    stop.wait()
    print(json.dumps(counts), flush=True)


def _client_hello() -> bytes:
    """The first flight of a TLS handshake to 127.0.0.1, to trickle byte by byte."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def slowloris(args: argparse.Namespace) -> None:
    """--slowloris connections trickling a request (or a ClientHello) until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    payload = _client_hello() if args.cert else _request()[:-2] + b"X-Padding: " + b"a" * 4096
    sel = selectors.DefaultSelector()
    conns: dict = {}  # socket -> [bytes sent, next send time]
    counts = {"opened": 0, "closed_by_server": 0}

    def open_one() -> None:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", args.port))
        conns[s] = [0, time.monotonic() + args.trickle_seconds]
        sel.register(s, selectors.EVENT_READ)
        counts["opened"] += 1

    def drop(s: socket.socket) -> None:
        sel.unregister(s)
        s.close()
        del conns[s]

    started, ramped = time.monotonic(), 0
    while not stop.is_set():
        due = min(args.slowloris, int((time.monotonic() - started) * args.slowloris_rate) + 1)
        while ramped < due:
            open_one()
            ramped += 1
        for key, _ in sel.select(timeout=0.1):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the server closed it: reopen at once, as an attacker would
                drop(s)
                counts["closed_by_server"] += 1
                open_one()
        now = time.monotonic()
        for s, state in list(conns.items()):
            if now >= state[1] and state[0] < len(payload):
                try:
                    state[0] += s.send(payload[state[0]:state[0] + 1])
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    drop(s)
                    counts["closed_by_server"] += 1
                    open_one()
                    continue
                state[1] = now + args.trickle_seconds
    print(json.dumps(counts), flush=True)


# -- the driver -------------------------------------------------------------------------------
def _self_signed(folder: str) -> tuple[str, str]:
    cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def _phase_rates(samples: list, start: float, end: float) -> tuple[float, float, float]:
    """(training steps per second, the training thread's CPU cores, the other threads' CPU cores)."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2:
        return float("nan"), float("nan"), float("nan")
    (t0, n0, p0, m0), (t1, n1, p1, m1) = inside[0], inside[-1]
    wall = t1 - t0
    return (n1 - n0) / wall, (m1 - m0) / wall, ((p1 - p0) - (m1 - m0)) / wall


def run_transport(args: argparse.Namespace, transport: str, folder: str) -> dict:
    cert, key = _self_signed(folder) if transport == "tls" else ("", "")
    out = os.path.join(folder, f"train-{transport}.json")
    env = dict(os.environ, PYTHONPATH=args.hvps_tree, OMP_NUM_THREADS="1")
    me = [sys.executable, os.path.abspath(__file__)]
    trainer = subprocess.Popen(me + ["--role", "train", "--cert", cert, "--key", key, "--out", out,
                                     "--nofile", str(args.nofile), "--extra-fds", str(args.extra_fds),
                                     "--width", str(args.width),
                                     "--batch", str(args.batch)],
                               env=env, stdout=subprocess.PIPE, text=True)
    port = json.loads(trainer.stdout.readline())["port"]

    scrapes: list = []  # (time, seconds or None)
    scraping = threading.Event()

    def scraper() -> None:
        while not scraping.wait(args.scrape_interval):
            started = time.monotonic()
            try:
                ok = scrape_once(port, cert, args.scrape_timeout)
            except (OSError, ssl.SSLError):
                ok = False
            scrapes.append((started, time.monotonic() - started if ok else None))

    scrape_thread = threading.Thread(target=scraper, daemon=True)
    scrape_thread.start()
    time.sleep(2.0)  # torch warm-up
    loads = [x for x in args.loads.split(",") if x and x != "idle"]
    phases: list = []  # (round, load, start, end, load's counts)
    for rnd in range(args.rounds):
        for load in ["idle"] + [x for pair in zip(loads, ["idle"] * len(loads)) for x in pair][:-1]:
            start = time.monotonic()
            counts = None
            seconds = args.slowloris_seconds if load == "slowloris" else args.phase_seconds
            if load == "idle":
                time.sleep(seconds)
            else:
                gen = subprocess.Popen(me + ["--role", load, "--port", str(port), "--cert", cert,
                                             "--clients", str(args.clients), "--slowloris", str(args.slowloris),
                                             "--slowloris-rate", str(args.slowloris_rate),
                                             "--trickle-seconds", str(args.trickle_seconds)],
                                       stdout=subprocess.PIPE, text=True)
                time.sleep(seconds)
                gen.send_signal(signal.SIGTERM)
                try:
                    counts = json.loads(gen.communicate(timeout=30)[0] or "null")
                except subprocess.TimeoutExpired:
                    gen.kill()
                    gen.communicate()
            phases.append((rnd, load, start, time.monotonic(), counts))
            if load != "idle":
                time.sleep(1.0)  # let the server drop what the load left behind
    scraping.set()
    scrape_thread.join()
    trainer.send_signal(signal.SIGTERM)
    trainer.wait(timeout=60)
    trained = json.loads(Path(out).read_text())

    per_load: dict = {}
    idle = float("nan")
    for rnd, load, start, end, counts in phases:
        speed, train_cpu, server_cpu = _phase_rates(trained["samples"], start + args.settle_seconds, end)
        if load == "idle":  # the ratio of a load phase is over the idle phase just before it
            idle = speed
        lat = [d for t, d in scrapes if start <= t <= end]
        row = per_load.setdefault(load, {"steps_per_s": [], "ratio": [], "training_thread_cores": [],
                                         "exporter_cores": [], "scrape_s": [], "scrapes_failed": 0,
                                         "load_counts": []})
        row["steps_per_s"].append(round(speed, 1))
        row["training_thread_cores"].append(round(train_cpu, 3))
        row["exporter_cores"].append(round(server_cpu, 3))
        row["ratio"].append(round(speed / idle, 3))
        row["scrape_s"].extend(d for d in lat if d is not None)
        row["scrapes_failed"] += sum(d is None for d in lat)
        if counts is not None:
            row["load_counts"].append(counts)
    summary = {}
    for load, row in per_load.items():
        lat = sorted(row.pop("scrape_s"))
        summary[load] = dict(
            ratio_median=statistics.median(row["ratio"]),
            steps_per_s_median=statistics.median(row["steps_per_s"]),
            exporter_cores_median=statistics.median(row["exporter_cores"]),
            scrape_median_s=round(statistics.median(lat), 4) if lat else None,
            scrape_max_s=round(lat[-1], 4) if lat else None, scrapes_ok=len(lat), **row)
    return {"port": port, "loads": summary, "emfile": trained["emfile"], "peak_fds": trained["peak_fds"],
            "peak_threads": trained["peak_threads"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role:
        {"train": train, "clients": clients, "slowloris": slowloris}[args.role](args)
        return
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "hvps_tree": args.hvps_tree,
              "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
              "settings": {k: getattr(args, k) for k in ("rounds", "phase_seconds", "slowloris_seconds",
                                                          "settle_seconds", "clients", "slowloris_rate", "extra_fds",
                                                          "slowloris", "trickle_seconds", "nofile", "width", "batch")},
              "transports": {}}
    with tempfile.TemporaryDirectory(prefix="hvps-metrics-load-") as folder:
        for transport in [t for t in args.transports.split(",") if t]:
            result["transports"][transport] = run_transport(args, transport, folder)
            print(f"{transport}: " + ", ".join(f"{ld} {row['ratio_median']:.3f}x"
                                               for ld, row in result["transports"][transport]["loads"].items()),
                  file=sys.stderr, flush=True)
    result["load_average_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
