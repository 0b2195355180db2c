"""Inner test: hvd.elastic's states, sampler and run loop on every rank of a real job (2 and 3 ranks).

The resets are real (``hvps.shutdown()`` then ``hvps.init()`` on the same MPI world, as an elastic
launcher's workers do on theirs); the failed collectives are real (shapes that differ across ranks,
which every rank sees as an HvpsError and the engine survives). Elastic mode is the environment's
``HVPS_ELASTIC=1``, set per test.
"""

import time
import zlib

import numpy as np
import pytest
import torch

import hvps
import hvps.adapters.torch as hvd
from hvps.elastic import HostsUpdatedInterrupt, HostUpdateResult, notify_hosts_updated

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _initialized():
    hvps.init()
    yield


def _seed(key, rank):
    torch.manual_seed(zlib.crc32(f"{key}#{rank}".encode()))


def _model():
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _step(model, optimizer, key):
    """One training step on fresh random data of this rank (the ranks diverge)."""
    _seed(key, hvps.rank())
    model.train()
    optimizer.zero_grad()
    model(torch.randn(8, 5)).pow(2).mean().backward()
    optimizer.step()


def _snapshot(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for i, s in optimizer.state_dict()["state"].items()})


def _assert_same(a, b):
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and oa.keys() == ob.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    for i in oa:
        for k in oa[i]:
            same = torch.equal(oa[i][k], ob[i][k]) if torch.is_tensor(oa[i][k]) else oa[i][k] == ob[i][k]
            assert same, (i, k)


def _flat(model):
    return torch.cat([v.double().flatten() for v in model.state_dict().values()]).numpy()


def _fresh_state(key):
    _seed(key, hvps.rank())  # every rank starts from different weights
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optimizer, key + "-warm")  # Adam has state (exp_avg, step) before the state is made
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return hvd.elastic.TorchState(model, optimizer, scheduler=scheduler, epoch=hvps.rank() + 3,
                                  notes={"rank": hvps.rank(), "seen": [hvps.rank()]})


def _fail_collective(name):
    """A real failed collective: rank 0 offers a different shape, and every rank gets an HvpsError."""
    hvps.allreduce(np.ones(3 if hvps.rank() == 0 else 2, np.float32), name=name)


def test_sync_makes_every_rank_rank_zeros_and_restore_is_exact():
    state = _fresh_state("sync")
    state.sync()
    gathered = hvps.allgather_object((_flat(state.model), state.optimizer.state_dict()["state"][0]["exp_avg"].numpy(),
                                      state.epoch, state.notes, state.scheduler.last_epoch))
    for flat, exp_avg, epoch, notes, last_epoch in gathered:
        np.testing.assert_array_equal(flat, gathered[0][0])
        np.testing.assert_array_equal(exp_avg, gathered[0][1])
        assert (epoch, notes, last_epoch) == (3, {"rank": 0, "seen": [0]}, gathered[0][4])
    # restore before any commit returns to the synced state (not to this rank's own start)
    synced = _snapshot(state.model, state.optimizer)
    _step(state.model, state.optimizer, "sync-1")
    state.notes["seen"].append("uncommitted")
    state.restore()
    _assert_same(_snapshot(state.model, state.optimizer), synced)
    assert state.notes == {"rank": 0, "seen": [0]}
    # commit, diverge, restore: bit-exact, twice (the restored tensors must not alias the commit)
    _step(state.model, state.optimizer, "sync-2")
    state.scheduler.step()
    state.epoch = 4
    state.commit()
    committed = _snapshot(state.model, state.optimizer)
    for attempt in range(2):
        _step(state.model, state.optimizer, f"sync-3-{attempt}")
        state.epoch = 99
        state.restore()
        _assert_same(_snapshot(state.model, state.optimizer), committed)
        assert state.epoch == 4 and state.scheduler.last_epoch == 1


def test_a_new_handled_value_is_tracked_and_saved():
    state = _fresh_state("assign")
    other = _model()
    state.model = other
    before = _snapshot(other, state.optimizer)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    state.restore()
    _assert_same(_snapshot(other, state.optimizer), before)


def test_host_update_on_rank_zero_interrupts_every_rank_at_the_same_commit():
    state = hvd.elastic.ObjectState(step=0)
    # a notice on the other ranks only is not acted on: rank 0's view counts
    if hvps.rank() != 0:
        state.on_hosts_updated(time.time(), HostUpdateResult.added)
    state.commit()
    for kind, skip in ((HostUpdateResult.removed, True), (HostUpdateResult.added, False),
                       (HostUpdateResult.mixed, False)):
        stamp = time.time()
        if hvps.rank() == 0:
            state.on_hosts_updated(stamp, kind)
            state.on_hosts_updated(stamp - 1000, HostUpdateResult.added)  # older: ignored
        with pytest.raises(HostsUpdatedInterrupt) as caught:
            state.commit()
        assert caught.value.skip_sync is skip
        state.commit()  # acted on: no second interrupt
    # a stale notice (not newer than the last one acted on) is ignored
    if hvps.rank() == 0:
        state.on_hosts_updated(stamp, HostUpdateResult.added)
    state.commit()


def test_run_resets_and_syncs_after_a_host_update():
    state = _fresh_state("reset")
    calls, resets = [], []
    state.register_reset_callbacks([lambda: resets.append((hvps.is_initialized(), hvps.size()))])

    @hvd.elastic.run
    def train(state, tag):
        calls.append(state.epoch)
        if len(calls) == 1:
            _step(state.model, state.optimizer, "reset-1")
            state.epoch += 10 + hvps.rank()  # committed on every rank: the sync after the reset makes them agree
            if hvps.rank() == 0:
                assert notify_hosts_updated(time.time(), "added") == 1
            state.commit()
            raise AssertionError("commit() should have raised HostsUpdatedInterrupt")
        return tag, _flat(state.model), state.epoch

    tag, flat, epoch = train(state, "done")
    assert tag == "done" and calls == [3, 13] and epoch == 13
    assert resets == [(True, hvps.size())]
    for other in hvps.allgather_object(flat):
        np.testing.assert_array_equal(other, flat)
    assert not issubclass(HostsUpdatedInterrupt, hvps.HvpsError)  # never taken for a failed collective


def test_removals_only_skip_the_sync():
    syncs = []

    class Counted(hvd.elastic.ObjectState):
        def sync(self):
            syncs.append(1)
            super().sync()

    state = Counted(step=0)

    @hvd.elastic.run
    def train(state):
        if state.step == 0:
            state.step = 1
            if hvps.rank() == 0:
                notify_hosts_updated(time.time(), HostUpdateResult.removed)
            state.commit()
        return state.step

    assert train(state) == 1 and len(syncs) == 1  # the first sync only


def test_a_failed_collective_outside_elastic_mode_names_the_elastic_launcher(monkeypatch):
    monkeypatch.delenv("HVPS_ELASTIC", raising=False)
    state = hvd.elastic.ObjectState(step=0)
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        _fail_collective("elastic.fail_static")

    with pytest.raises(hvps.HvpsError) as caught:
        train(state)
    message = str(caught.value)
    for needle in ("not started in elastic mode", "--min-np", "--max-np", "--host-discovery-script",
                   "CheckpointManager", "--max-restarts", "elastic.fail_static"):
        assert needle in message, needle
    assert calls == [1] and hvps.is_initialized()
    assert hvps.allreduce(np.ones(2), op=hvps.Sum).tolist() == [hvps.size()] * 2  # the job goes on


def test_elastic_mode_restores_the_commit_and_retries(monkeypatch):
    monkeypatch.setenv("HVPS_ELASTIC", "1")
    state = _fresh_state("retry")
    seen, resets, committed = [], [], []
    state.register_reset_callbacks([lambda: resets.append(hvps.size())])

    @hvd.elastic.run
    def train(state):
        seen.append((state.epoch, _snapshot(state.model, state.optimizer)))
        if len(seen) == 1:
            _step(state.model, state.optimizer, "retry-1")
            state.epoch = 7
            state.commit()
            committed.append(_snapshot(state.model, state.optimizer))
            _step(state.model, state.optimizer, "retry-2")  # lost: not committed
            state.epoch = 8
            _fail_collective("elastic.fail_elastic")
        return state.epoch

    assert train(state) == 7
    assert resets == [hvps.size()] and [epoch for epoch, _ in seen] == [3, 7]
    if hvps.rank() == 0:  # restored bit-exactly, then broadcast to the others by the sync
        _assert_same(seen[1][1], committed[0])
    for other in hvps.allgather_object(_flat(state.model)):
        np.testing.assert_array_equal(other, _flat(state.model))


def test_elastic_mode_syncs_when_a_joining_worker_needs_it_although_the_others_skip(monkeypatch):
    """Horovod issue 3494: survivors of a removal skip the sync while a worker that joined syncs, and the
    job deadlocks. Here the last rank plays the joined worker: it leaves at the same commit, re-initializes
    and enters the loop afresh with a new state; the survivors' reset sees that it needs the sync."""
    monkeypatch.setenv("HVPS_ELASTIC", "1")
    newcomer = hvps.rank() == hvps.size() - 1

    class Leaving(Exception):
        pass

    @hvd.elastic.run
    def train(state):
        if state.phase == 0:
            state.phase = 1
            if hvps.rank() == 0:
                notify_hosts_updated(time.time(), HostUpdateResult.removed)
            try:
                state.commit()
            except HostsUpdatedInterrupt as interrupt:
                assert interrupt.skip_sync
                if newcomer and state.origin >= 0:
                    raise Leaving() from interrupt
                raise
        return state.phase, state.origin

    state = hvd.elastic.ObjectState(phase=0, origin=hvps.rank())
    if newcomer:
        with pytest.raises(Leaving):
            train(state)
        hvps.shutdown()  # the survivors' reset, on this side
        hvps.init()
        state = hvd.elastic.ObjectState(phase=0, origin=-1)  # a worker that has just started
    assert train(state) == (1, 0)  # rank 0's committed state on every rank: the sync was not skipped


def test_sampler_splits_what_is_left_over_the_ranks():
    size, rank = hvps.size(), hvps.rank()
    rng = np.random.default_rng(zlib.crc32(b"sampler"))
    length, batch = int(rng.integers(40, 80)), int(rng.integers(2, 5))
    dataset = list(range(length))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=int(rng.integers(0, 1000)))
    state = hvd.elastic.TorchState(sampler=sampler)
    state.sync()
    sampler.set_epoch(1)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler)
    shares = hvps.allgather_object(list(sampler))
    assert sorted(set().union(*map(set, shares))) == dataset  # every index, each rank's share as long
    assert len({len(s) for s in shares}) == 1
    done = int(rng.integers(1, len(sampler) // batch))
    for batch_idx, _ in enumerate(loader):
        if batch_idx == done:
            break
        sampler.record_batch(batch_idx, batch)
    state.commit()
    state.sync()
    processed = set().union(*[set(s[:done * batch]) for s in shares])
    assert sampler.processed_indices == processed and sampler.processed_num == len(processed)
    left = hvps.allgather_object(list(sampler))
    assert set().union(*map(set, left)) == set(dataset) - processed
    assert all(len(s) == -(-(length - len(processed)) // size) for s in left)
    assert not set(left[rank]) & processed
    state.restore()  # the commit was before the sync: the sync saved the joined view
    assert sampler.processed_indices == processed


@pytest.mark.parametrize("options", ["topk", "one_group"])
@pytest.mark.parametrize("point", ["backward", "between", "synchronized"])
def test_a_failure_mid_step_leaves_the_optimizer_ready_and_the_error_feedback_at_the_commit(monkeypatch, point,
                                                                                          options):
    """A collective fails in the middle of a step (inside backward, after it, or after synchronize()
    and before step()), with backward_passes_per_step=2 and top-k error feedback, or all gradients in
    one group (inside backward the group is then half ready): the restore forgets the step (handles,
    countdowns, the partial group, the synchronized flag) and puts the residuals back to the
    commit's, so the step run again is bit-exact the uninterrupted run's."""
    monkeypatch.setenv("HVPS_ELASTIC", "1")
    def build():
        extra = {"compression": hvd.Compression.topk(0.5)} if options == "topk" else {"groups": 1}  # fresh memory
        _seed("midstep", 0)  # the same start on every rank
        model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5),
                                             named_parameters=model.named_parameters(), backward_passes_per_step=2,
                                             **extra)
        return model, optimizer

    def backward(model, key, hook=None):
        _seed(key, hvps.rank())
        hidden = model[0](torch.randn(4, 6))
        if hook is not None:
            hidden.register_hook(hook)
        model[1](hidden).pow(2).sum().backward()

    def step(model, optimizer, key):
        optimizer.zero_grad()
        backward(model, key + ".0")
        backward(model, key + ".1")
        optimizer.step()

    model, optimizer = build()  # the uninterrupted run
    for key in ("a", "b", "c"):
        step(model, optimizer, key)
    expected = _flat(model)

    model, optimizer = build()
    state = hvd.elastic.TorchState(model, optimizer, done=0)
    tries = []

    @hvd.elastic.run
    def train(state):
        tries.append(state.done)
        for key in ("a", "b", "c")[state.done:]:
            if key == "b" and len(tries) == 1:  # interrupted at `point`, once
                optimizer.zero_grad()
                backward(model, "b.0")
                fail = (lambda grad: _fail_collective("elastic.mid_backward")) if point == "backward" else None
                backward(model, "b.1", hook=fail)  # the second pass: the last layer's exchange starts
                if point == "synchronized":
                    optimizer.synchronize()
                _fail_collective(f"elastic.mid_{point}")
            step(model, optimizer, key)
            state.done += 1
            state.commit()
        return _flat(model)

    np.testing.assert_array_equal(train(state), expected)
    assert tries == [0, 1]
