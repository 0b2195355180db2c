"""Rank 0's negotiation work per step at 2 to 4,096 ranks, star against tree, in one process.

A machine of 2 cores cannot run 1,024 ranks, and oversubscribed runs (``negotiation.py``) measure
preemption as much as negotiation. This benchmark runs the code rank 0 runs on what it receives,
without the processes that send it: every child's announcement messages are prepared beforehand
with the real response cache and the real authenticated framing, and then rank 0's part is timed:

* open (HMAC check, JSON parse) each child's messages, resolve their bits, submit them to the
  coordinator, poll it, encode the responses and seal them once per child;
* plus, per message received or sent, the cost of one ``send``/``recv`` pair over a local socket,
  measured here, so that system calls count too.

Times are the thread's CPU time (``time.thread_time``), so a busy machine slows the run but not the
result.

Shapes: ``star`` (every rank reports to rank 0: ``HVPS_CONTROL_FANOUT`` of 0, or any job of at most
fan-out + 1 ranks) and ``tree-K`` (K children per rank, ``tree.py``); for a tree the busiest relay's
part is timed too: open its children's messages, merge them (``relay.py``), seal one upward message,
pass rank 0's responses down to each child and decode them. Each rank announces its 161 cached
tensors (ResNet-50's count) in ``--messages`` messages per step (the engine announces once per cycle
while a backward pass submits), and every rank announces every tensor, as in steady training.

    python benchmarks/coordinator_scale.py --ranks 2 8 64 256 1024 4096 --fanout 32 --json out.json
"""
from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import median, write_json  # noqa: E402
from hvps.control.negotiation import ALLREDUCE, Coordinator, Request  # noqa: E402
from hvps.control.plane import _REQUESTS, _RESPONSES  # noqa: E402
from hvps.control.relay import RelayBuffer  # noqa: E402
from hvps.control.response_cache import ResponseCache  # noqa: E402
from hvps.control.tree import position  # noqa: E402
from hvps.control.wire import Session, encode  # noqa: E402

TENSORS = 161
KEY = bytes(32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 8, 64, 256, 1024, 4096], help="job sizes")
    p.add_argument("--fanout", type=int, nargs="+", default=[32], help="tree fan-outs to time beside the star")
    p.add_argument("--messages", type=int, default=4, help="announcement messages per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per shape (median)")
    p.add_argument("--json", default="", help="write results as JSON to this path")
    return p.parse_args(argv)


def _requests() -> list:
    return [Request(f"allreduce.grad.{i}", ALLREDUCE, "float32", ((8,),), "sum") for i in range(TENSORS)]


def _chunks(items: list, count: int) -> list:
    size = -(-len(items) // count)
    return [items[i:i + size] for i in range(0, len(items), size)]


def syscall_cost(nbytes: int, rounds: int = 2000) -> float:
    """Seconds for one send and one recv of ``nbytes`` over a local socket pair."""
    a, b = socket.socketpair()
    data = b"x" * nbytes
    start = time.thread_time()
    for _ in range(rounds):
        a.send(data)
        got = 0
        while got < nbytes:
            got += len(b.recv(65536))
    elapsed = (time.thread_time() - start) / rounds
    a.close()
    b.close()
    return elapsed


class Rank0:
    """Rank 0's coordinator and cache, fed the prepared messages of its children."""

    def __init__(self, size: int, blocks: list) -> None:
        self.children = [block.start for block in blocks]
        self.cache = ResponseCache(1024, size, 0, children={block.start: block for block in blocks})
        self.coordinator = Coordinator(size, 64 * 1024 * 1024, 60.0)
        self.inbound = {child: Session(KEY, b"r0", b"w") for child in self.children}
        self.outbound = {child: Session(KEY, b"r0", b"w") for child in self.children}

    def step(self, own: list, payloads: list) -> tuple:
        """One step: ``payloads`` ``[(child, sealed frame)]``; returns the response body and messages sent."""
        self.coordinator.submit(0, self.cache.canonical(own), 0.0)
        for child, payload in payloads:
            message = self.inbound[child].open(payload[4:], _REQUESTS)
            self.coordinator.submit_pairs(self.cache.resolve(child, message), 0.0)
        responses = self.coordinator.poll(0.0)
        body = encode({"responses": self.cache.encode_responses(responses)})
        for child in self.children:
            self.outbound[child].seal_encoded(body)
        return body, len(self.children)


def prepare(size: int, fanout: int, messages: int, worker: ResponseCache, sealers: dict) -> list:
    """Rank 0's children's sealed messages for one step (``sealers``: each child's session): each leaf
    child's own, each relay's merge."""
    tree = position(0, size, fanout)
    requests = _requests()
    payloads = []
    for block in tree.blocks:
        sealer = sealers[block.start]
        if len(block) == 1:
            for part in _chunks(requests, messages):
                payloads.append((block.start, sealer.seal(worker.announce(part))))
            continue
        below = position(block.start, size, fanout).blocks
        relay = RelayBuffer(block, below, hold_s=1.0)
        for part in _chunks(requests, messages):
            message = worker.announce(part)
            relay.add(block.start, message, 0.0)
            for child in below:
                relay.add(child.start, _from_block(child, message), 0.0)
            upward = relay.take(0.0, worker.epoch)
            if upward is not None:
                payloads.append((block.start, sealer.seal(upward)))
    return payloads


def _from_block(block: range, message: dict) -> dict:
    """What the child heading ``block`` sends when every rank of it announced ``message``'s requests."""
    if len(block) == 1:
        return message
    items = message["requests"]
    if all(isinstance(item, int) for item in items):
        return {"whole": items, "epoch": message["epoch"]}
    return {"batch": [[item, [[block.start, block.stop]]] for item in items], "epoch": message["epoch"]}


def relay_step(size: int, fanout: int, messages: int, worker: ResponseCache, decoder: ResponseCache,
               response_body: bytes) -> tuple:
    """The busiest relay's part of one step (rank 0's first child, whose cache is ``decoder``): seconds, and
    messages it received or sent."""
    here = position(position(0, size, fanout).blocks[0].start, size, fanout)
    requests = _requests()
    children, opener = Session(KEY, b"w", b"r"), Session(KEY, b"r", b"w")
    inbound = []
    for part in _chunks(requests, messages):
        message = worker.announce(part)
        inbound += [(child.start, children.seal(_from_block(child, message))) for child in here.blocks]
    down, from_rank0 = Session(KEY, b"r0", b"w").seal_encoded(response_body), Session(KEY, b"w", b"r0")
    sealer = Session(KEY, b"r", b"r0")
    relay = RelayBuffer(here.subtree, here.blocks, hold_s=1.0)
    start = time.thread_time()
    sent = 0
    for part in _chunks(requests, messages):
        relay.add(here.rank, decoder.announce(part), 0.0)
    for child, payload in inbound:
        relay.add(child, opener.open(payload[4:], _REQUESTS), 0.0)
        upward = relay.take(0.0, decoder.epoch)
        if upward is not None:
            sealer.seal(upward)
            sent += 1
    message = from_rank0.open(down[4:], _RESPONSES)
    body = encode(message)
    for _ in here.children:
        sealer.seal_encoded(body)
    decoder.decode_responses(message["responses"])
    return time.thread_time() - start, len(inbound) + 1 + sent + len(here.children)


def run_shape(size: int, fanout: int, args: argparse.Namespace) -> dict:
    """Median over steps of rank 0's (and the busiest relay's) work per step for one job size and shape."""
    tree = position(0, size, fanout)
    worker = ResponseCache(1024, size, 1)  # every worker's cache: they all record the same responses
    relay_cache = ResponseCache(1024, size, tree.blocks[0].start)
    rank0 = Rank0(size, list(tree.blocks))
    requests = _requests()
    per_message = {"in": syscall_cost(2048), "out": syscall_cost(1024)}
    rank0_s, relay_s, counts = [], [], {}
    sealers = {block.start: Session(KEY, b"w", b"r0") for block in tree.blocks}
    for step in range(args.steps + 1):  # the first step is uncached: every request in full
        payloads = prepare(size, fanout, args.messages, worker, sealers)
        start = time.thread_time()
        body, sent = rank0.step(requests, payloads)
        elapsed = time.thread_time() - start
        counts = {"received": len(payloads), "sent": sent}
        if any(len(block) > 1 for block in tree.blocks):
            seconds, relay_messages = relay_step(size, fanout, args.messages, worker, relay_cache, body)
            if step:
                relay_s.append(seconds + relay_messages * per_message["in"])
        worker.decode_responses(Session(KEY, b"w", b"r0").open(
            Session(KEY, b"r0", b"w").seal_encoded(body)[4:], _RESPONSES)["responses"])
        if step:  # the first step is uncached: not timed
            rank0_s.append(elapsed + len(payloads) * per_message["in"] + sent * per_message["out"])
    return {"ranks": size, "fanout": fanout, "rank0_s": median(rank0_s), "relay_s": median(relay_s) if relay_s else 0.0,
            "messages_received": counts["received"], "messages_sent": counts["sent"],
            "syscall_s_per_message": per_message}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    print(f"# rank 0's negotiation per step, {TENSORS} cached tensors, {args.messages} messages per rank per step, ms")
    print(f"{'ranks':>6} {'shape':>8} | {'rank 0':>8} {'received':>8} | {'busiest relay':>13}")
    for size in args.ranks:
        for name, fanout in [("star", max(size - 1, 1))] + [(f"tree-{k}", k) for k in args.fanout]:
            row = dict(run_shape(size, fanout, args), shape=name)
            rows.append(row)
            print(f"{size:>6} {name:>8} | {row['rank0_s'] * 1e3:8.2f} {row['messages_received']:8d} | "
                  f"{row['relay_s'] * 1e3:13.2f}", flush=True)
    write_json(args.json, {"benchmark": "coordinator_scale", "tensors": TENSORS, "messages": args.messages,
                           "rows": rows})


if __name__ == "__main__":
    main()
