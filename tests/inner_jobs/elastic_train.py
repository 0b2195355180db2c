"""Run by tests/test_elastic_launch.py under hvpsrun's elastic mode: Horovod's elastic training pattern.

Every rank logs one JSON line per epoch: epoch, rank, size, start rank, host and rendezvous count
(Horovod's ``test/integration/data/elastic_torch_main.py`` logs the same). The model is chosen so
that every update is exact in float64 (dyadic data and learning rate, a Sum allreduce, a global
batch of 8 samples split over however many ranks there are): the final parameters are bit-exact
those of :func:`reference` when every step of every epoch is applied exactly once, whatever the
membership changes and failures in between.

``SCHEDULE`` (JSON) says what happens at the start of an epoch, once per job:
``{"1": {"hosts": "localhost:2\\n127.0.0.1:1"}}`` rewrites ``HOSTS_FILE`` (the discovery script's
answer; rank 0 then waits until hvpsrun's notice has arrived, so the change lands at this epoch);
``{"1": {"fail": [1], "how": "exit"}}`` makes ranks 1 fail: ``exit`` (status 1), ``kill`` (SIGKILL),
``raise`` (an exception out of the training function), ``stop`` (SIGSTOP), ``leave`` (status 0, Horovod issue 3852).
An action happens once per job, or with ``"round": N`` whenever the epoch starts in rendezvous N
(so that all of several ranks act, not only the first to get there), or with ``"always": true`` every time.
``"how": "hvps_error"`` raises an HvpsError (a failed collective, as every rank would see it).

``{"1": {"forge": ["notice", "failed", "round"]}}`` makes rank 0 play a stranger who reaches the
rendezvous store (issue 38): from then on a process of its own, on a connection of its own, keeps writing
garbage to ``elastic/notice`` and to every ``elastic/failed/N/<worker>`` key of the next rounds, and the
authentic value ``elastic/round`` held when it started (a replay).

``SHARDED=3`` trains the same model wrapped by ``hvd.fully_shard`` (ZeRO stage 3, a Sum reduce-scatter) with a
plain SGD over its shards, in the same TorchState: a lost rank's shard comes back from its neighbour's copy, with
no checkpoint (there is none). ``SHARDED=1`` shards the optimizer state only (``DistributedOptimizer(...,
shard=True)``, ZeRO stage 1-2). Each rank then prints, after its first step following a failed collective,
``{"recovery_seconds": ...}``: from the failure's detection (hvps's warning) to that step's end.

``"at": "backward" | "between" | "step"`` moves a failure into the step of the epoch's batch 1, with
gradients in flight, whenever the job has ``"size"`` ranks: ranks ``fail`` die there (``how``) and the
others meet the failure at that point of their own step: ``backward`` inside ``loss.backward()``
(the bias's allreduce started, the weight's not yet: a collective the dead rank never joins fails in a
tensor hook between the two), ``between`` after ``backward()`` and before ``step()`` (both in
flight; the same failing collective), ``step`` inside ``optimizer.step()`` (the dead rank died in its
backward before starting the weight's allreduce, which the others' ``step()`` then waits for).
"""

import contextlib
import json
import logging
import os
import signal
import sys
import time

import torch

import hvps.adapters.torch as hvd
from hvps.adapters.torch.fully_sharded import FullyShardedModel
from hvps.runtime.bootstrap import elastic_session

EPOCHS = int(os.environ.get("EPOCHS", "4"))
BATCHES, GLOBAL_BATCH, LR = 3, 8, 2.0 ** -4
#: seconds each epoch lasts at least (rank 0 waits at its end), so that slow membership changes land mid-run
EPOCH_SECONDS = float(os.environ.get("EPOCH_SECONDS", "0"))


def batch_data(epoch: int, batch: int) -> torch.Tensor:
    """The global batch of (epoch, batch): small integers, the same on every rank."""
    generator = torch.Generator().manual_seed(1000 * epoch + batch)
    return torch.randint(-4, 5, (GLOBAL_BATCH, 4), generator=generator).double()


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    model = torch.nn.Linear(4, 1).double()
    with torch.no_grad():  # dyadic start values
        model.weight.copy_(torch.round(model.weight * 64) / 64)
        model.bias.copy_(torch.round(model.bias * 64) / 64)
    return model


def step(model, optimizer, x: torch.Tensor, interrupt=None) -> None:
    """One step; ``interrupt(point)`` is called at "backward", "between" and "step" (see the module)."""
    optimizer.zero_grad()
    out = x @ model.weight.t()  # model(x), split so that a hook runs between the bias's and the weight's gradient
    if interrupt is not None:
        out.register_hook(lambda grad: interrupt("backward"))
    (out + model.bias).sum().backward()
    if interrupt is not None:
        interrupt("between")
    optimizer.step()


def sharded_step(model, optimizer, x: torch.Tensor, interrupt=None) -> None:
    """One step of the fully sharded model (its forward must run through ``model(x)``); ``interrupt`` is
    called at "between" only."""
    optimizer.zero_grad()
    model(x).sum().backward()
    if interrupt is not None:
        interrupt("between")
    optimizer.step()


class RecoveryClock(logging.Handler):
    """Notes when hvps reports a failed collective (the detection), for the recovery time."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.detected = None

    def emit(self, record: logging.LogRecord) -> None:
        if "a collective failed" in record.getMessage():
            self.detected = time.monotonic()

    def report_after_step(self) -> None:
        if self.detected is not None:
            print(json.dumps({"recovery_seconds": round(time.monotonic() - self.detected, 3), "rank": hvd.rank(),
                              "size": hvd.size()}), flush=True)
            self.detected = None


def reference(epochs: int = EPOCHS) -> list:
    """The uninterrupted run on one process: every step on the whole global batch."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    for epoch in range(epochs):
        for batch in range(BATCHES):
            step(model, optimizer, batch_data(epoch, batch))
    return [p.detach().flatten().tolist() for p in model.parameters()]


def interruption(schedule: dict, epoch: int, batch: int):
    """The ``interrupt(point)`` of batch ``batch`` of ``epoch`` (None when none is scheduled)."""
    what = schedule.get(str(epoch))
    if not what or "at" not in what or batch != 1 or hvd.size() != what["size"]:
        return None
    victim = hvd.rank() in what["fail"]

    def interrupt(point: str) -> None:
        if victim and point == ("backward" if what["at"] == "step" else what["at"]):
            die(what.get("how", "kill"), epoch)
        if not victim and point == what["at"] != "step":  # a collective the dead ranks never join
            hvd.allreduce(torch.zeros(1, dtype=torch.float64), name=f"probe.{epoch}")
            raise AssertionError(f"the probe at {point} did not fail although ranks {what['fail']} died")

    return interrupt


def die(how: str, epoch: int) -> None:
    print(json.dumps({"failing": hvd.rank(), "how": how, "epoch": epoch}), flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":  # caught by the others' stall timeout; hvpsrun ends it
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == "raise":
        raise RuntimeError(f"rank {hvd.rank()} fails on purpose at epoch {epoch}")
    if how == "hvps_error":
        raise hvd.HvpsError(f"rank {hvd.rank()} fails a collective on purpose at epoch {epoch}")
    os._exit(0 if how == "leave" else 1)


def forge(what: list) -> None:
    """A stranger's writes to the rendezvous store, every 10 ms from now on (see the module's docstring), from
    a process of its own that ends with this one."""
    import subprocess

    from hvps.control import membership

    workers = sorted(membership.round_slots(elastic_session.store, elastic_session.secret, elastic_session.round))
    ready = os.path.join(os.environ["OUT_DIR"], "forging")
    subprocess.Popen([sys.executable, __file__, "forge", json.dumps(what), str(elastic_session.round),
                      json.dumps(workers), ready], env=os.environ)
    deadline = time.monotonic() + 150
    while not os.path.exists(ready) and time.monotonic() < deadline:  # training goes on once it forges
        time.sleep(0.05)


def forger(what: list, first: int, workers: list, ready: str) -> None:
    import datetime

    import torch.distributed as dist

    from hvps.control import membership

    parent = os.getppid()
    store = dist.TCPStore(os.environ["HVPS_RENDEZVOUS_ADDR"].split(",")[0], int(os.environ["HVPS_RENDEZVOUS_PORT"]),
                          None, False, datetime.timedelta(seconds=120), wait_for_workers=False)
    replay = store.get(membership.ROUND_KEY)
    while os.getppid() == parent:
        if "notice" in what:
            store.set(membership.NOTICE_KEY, json.dumps({"round": 10 ** 6, "timestamp": 1e12, "kind": 3}))
        if "failed" in what:
            for number in range(first, first + 4):
                for worker in workers:
                    store.set(membership.failed_key(number, worker), "forged")
        if "round" in what:
            store.set(membership.ROUND_KEY, replay)
        if not os.path.exists(ready):
            open(ready, "w").close()
        time.sleep(0.01)


def act(schedule: dict, epoch: int, out_dir: str) -> None:
    what = schedule.get(str(epoch))
    marker = os.path.join(out_dir, f"done-{epoch}")
    if not what or "at" in what or ("round" in what and what["round"] != elastic_session.round):
        return
    # the stranger first, under a marker of its own: a failing rank may reach this epoch (and write its marker)
    # before rank 0, which sleeps at the end of every epoch
    if "forge" in what and hvd.rank() == 0 and not os.path.exists(marker + "-forge"):
        open(marker + "-forge", "w").close()
        forge(what["forge"])
    if "round" not in what and not what.get("always") and os.path.exists(marker):
        return
    if "hosts" in what and hvd.rank() == 0:
        with open(os.environ["HOSTS_FILE"] + ".tmp", "w") as f:
            f.write(what["hosts"] + "\n")
        os.replace(os.environ["HOSTS_FILE"] + ".tmp", os.environ["HOSTS_FILE"])
        open(marker, "w").close()
        deadline = time.monotonic() + 20
        while elastic_session.pending_notice() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    if hvd.rank() in what.get("fail", []):
        open(marker, "w").close()
        die(what.get("how", "exit"), epoch)


def main() -> None:
    hvd.init()
    start_rank = hvd.rank()
    schedule = json.loads(os.environ.get("SCHEDULE", "{}"))
    out_dir = os.environ["OUT_DIR"]
    model = make_model()
    sharded = os.environ.get("SHARDED") == "3"
    clock = RecoveryClock()
    if os.environ.get("SHARDED"):
        logging.getLogger("hvps").addHandler(clock)
        logging.getLogger("hvps").addHandler(logging.StreamHandler())  # the warnings still reach stderr
    if sharded:
        hvd.fully_shard(model, op=hvd.Sum)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    else:
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5),
                                             named_parameters=model.named_parameters(), op=hvd.Sum,
                                             shard=os.environ.get("SHARDED") == "1")
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        while state.epoch < EPOCHS:
            if state.batch == 0:
                act(schedule, state.epoch, out_dir)
            while state.batch < BATCHES:
                x = batch_data(state.epoch, state.batch)[hvd.rank()::hvd.size()]
                (sharded_step if sharded else step)(model, optimizer, x, interruption(schedule, state.epoch,
                                                                                      state.batch))
                clock.report_after_step()
                state.batch += 1
                state.commit()
            print(json.dumps({"epoch": state.epoch, "rank": hvd.rank(), "size": hvd.size(), "start_rank": start_rank,
                              "host": os.environ.get("HOROVOD_HOSTNAME"), "rendezvous": elastic_session.round}),
                  flush=True)
            if hvd.rank() == 0:
                time.sleep(EPOCH_SECONDS)
            state.epoch, state.batch = state.epoch + 1, 0
            state.commit()

    train(state)
    with FullyShardedModel.of(model).full_parameters() if sharded else contextlib.nullcontext():
        if hvd.rank() == 0:
            with open(os.path.join(out_dir, "final.json"), "w") as f:
                json.dump([p.detach().flatten().tolist() for p in model.parameters()], f)
    hvd.shutdown()


if __name__ == "__main__":
    if sys.argv[1:] == ["reference"]:
        print(json.dumps(reference()))
    elif sys.argv[1:2] == ["forge"]:
        forger(json.loads(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5])
    else:
        main()
