"""hvd.elastic's framework-neutral parts in one process, without ``hvps.init()``: states driven by their own
broadcast function (Horovod's ``State(bcast_object, get_rank)``; one process broadcasts to itself), the
host-update notices, the retry loop with its own reset (Horovod's ``run_fn(func, reset)``), the torchrun
refusal and the sampler's split. The same parts on real ranks, with real resets: tests/mpi/mpi_elastic_state.py."""

import time

import pytest

import hvps
from hvps.elastic import (
    MAX_RESETS_WITHOUT_COMMIT,
    HostsUpdatedInterrupt,
    HostUpdateResult,
    ObjectState,
    State,
    WorkerNotificationManager,
    elastic_mode,
    notification_manager,
    notify_hosts_updated,
    run_fn,
    torchrun_restarts,
)

pytestmark = pytest.mark.unit


def _state(**kwargs):
    return ObjectState(bcast_object=lambda obj: obj, get_rank=lambda: 0, **kwargs)


@pytest.fixture(autouse=True)
def _static_job(monkeypatch):
    for name in ("HVPS_ELASTIC", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)


def test_object_state_commit_restore_and_sync_copy_the_values():
    broadcasts = []

    def rank_zeros(obj):  # what rank 0 would send: its own saved dict (host-update checks pass through)
        if isinstance(obj, dict):
            broadcasts.append(obj)
            return {"epoch": 5, "seen": [9]}
        return obj

    state = ObjectState(bcast_object=rank_zeros, get_rank=lambda: 0, epoch=0, seen=[])
    state.seen.append(1)  # uncommitted, in place
    state.epoch = 2
    state.restore()
    assert (state.epoch, state.seen) == (0, [])
    state.seen.append(1)
    state.commit()
    state.seen.append(2)  # after the commit, in place: restore must not see it
    state.restore()
    assert state.seen == [1]
    state.restore()
    assert state.seen == [1]
    state.sync()
    assert broadcasts == [{"epoch": 0, "seen": [1]}] and (state.epoch, state.seen) == (5, [9])


@pytest.mark.parametrize("name", ["commit", "sync", "_saved_state", "register_reset_callbacks"])
def test_an_attribute_that_would_hide_the_state_is_refused(name):
    with pytest.raises(ValueError, match=f"{name!r} would hide"):
        _state(**{name: 1})


def test_the_base_state_names_what_a_subclass_must_implement():
    state = State(bcast_object=lambda obj: obj, get_rank=lambda: 0)
    for method in ("save", "restore", "sync"):
        with pytest.raises(NotImplementedError, match=f"State must implement {method}"):
            getattr(state, method)()
    with pytest.raises(TypeError, match="not callable"):
        state.register_reset_callbacks([1])


def test_host_updates_interrupt_once_per_newer_notice():
    state = _state(step=0)
    state.commit()  # nothing pending
    now = time.time()
    state.on_hosts_updated(now, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.commit()
    assert caught.value.skip_sync
    state.commit()  # acted on
    state.on_hosts_updated(now, HostUpdateResult.added)  # not newer: ignored
    state.commit()
    state.on_hosts_updated(now + 1, HostUpdateResult.removed)
    state.on_hosts_updated(now + 2, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as caught:
        state.check_host_updates()
    assert not caught.value.skip_sync  # an addition among them: the state must be synced
    state.on_hosts_updated(now + 3, HostUpdateResult.added)
    state.on_reset()  # a reset forgets the notices from before it
    state.commit()


def test_the_notification_manager_forwards_to_running_loops_only():
    manager = WorkerNotificationManager()
    state = _state(step=0)
    assert manager.handle_hosts_updated(1.0, "added") == 0  # nobody listening: dropped
    manager.register_listener(state)
    manager.register_listener(state)
    assert manager.handle_hosts_updated(2.0, 2) == 1
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    manager.remove_listener(state)
    assert manager.listeners() == []
    for bad_time in ("soon", float("nan"), True):
        with pytest.raises(ValueError, match="timestamp"):
            manager.handle_hosts_updated(bad_time, "added")
    for bad_kind in ("grown", 7, None):
        with pytest.raises(ValueError, match="removed, added, mixed"):
            manager.handle_hosts_updated(3.0, bad_kind)


def test_run_syncs_first_and_resets_on_a_host_update():
    events = []

    class Recorded(ObjectState):
        def sync(self):
            events.append("sync")
            super().sync()

    state = Recorded(bcast_object=lambda obj: obj, get_rank=lambda: 0, step=0)
    state.register_reset_callbacks([lambda: events.append("callback")])

    def train(state, limit, scale=1):
        events.append(f"train {state.step}")
        while state.step < limit:
            state.step += 1
            if state.step == 2:
                assert notify_hosts_updated(time.time(), HostUpdateResult.added) == 1
            if state.step == 4:
                notify_hosts_updated(time.time(), HostUpdateResult.removed)
            state.commit()
        return state.step * scale

    wrapped = run_fn(train, reset=lambda: events.append("reset"))
    assert wrapped.__name__ == "train"
    assert wrapped(state, 5, scale=10) == 50
    assert events == ["sync", "train 0", "reset", "callback", "sync", "train 2", "reset", "callback", "train 4"]
    assert notification_manager.listeners() == []  # the loop unregistered its state


def test_a_sharded_state_syncs_after_a_removal_too():
    """A state whose ranks hold different parts (a fully sharded model) must re-shard after every reset: the
    sync that a removal-only reset leaves out for a replicated state runs for it."""
    events = []

    class Sharded(ObjectState):
        same_on_every_rank = False

        def sync(self):
            events.append("sync")
            super().sync()

    state = Sharded(bcast_object=lambda obj: obj, get_rank=lambda: 0, step=0)

    def train(state):
        while state.step < 2:
            state.step += 1
            if state.step == 1:
                notify_hosts_updated(time.time(), HostUpdateResult.removed)
            state.commit()
        return state.step

    assert run_fn(train, reset=lambda: events.append("reset"))(state) == 2
    assert events == ["sync", "reset", "sync"]


def test_a_failed_collective_outside_elastic_mode_is_not_retried():
    calls, resets = [], []

    def train(state):
        calls.append(1)
        raise hvps.HorovodInternalError("allreduce 'grads' failed: rank 1 died")

    with pytest.raises(hvps.HvpsError) as caught:
        run_fn(train, reset=lambda: resets.append(1))(_state(step=0))
    message = str(caught.value)
    assert message.startswith("allreduce 'grads' failed: rank 1 died -- ")
    for needle in ("not started in elastic mode", "hvpsrun --min-np N --max-np M --host-discovery-script SCRIPT",
                   "hvd.CheckpointManager", "hvpsrun --max-restarts N"):
        assert needle in message
    assert calls == [1] and resets == [] and isinstance(caught.value.__cause__, hvps.HvpsError)


def test_argument_errors_and_other_exceptions_pass_through():
    def duplicate(state):
        raise hvps.DuplicateNameError("allreduce 'x' is in flight")

    def broken(state):
        raise KeyError("user bug")

    with pytest.raises(hvps.DuplicateNameError, match="in flight"):
        run_fn(duplicate)(_state(step=0))
    with pytest.raises(KeyError, match="user bug"):
        run_fn(broken)(_state(step=0))
    with pytest.raises(TypeError, match="must be an elastic state"):
        run_fn(broken)({"step": 0})
    with pytest.raises(TypeError, match="wraps a function"):
        run_fn(None)


def test_a_loop_that_never_commits_gives_up():
    resets = []

    def train(state):
        raise HostsUpdatedInterrupt(skip_sync=True)

    with pytest.raises(hvps.HvpsError, match=f"gave up after {MAX_RESETS_WITHOUT_COMMIT + 1} resets in a row"):
        run_fn(train, reset=lambda: resets.append(1))(_state(step=0))
    assert len(resets) == MAX_RESETS_WITHOUT_COMMIT


def test_a_commit_that_a_notice_interrupts_every_time_is_no_progress(monkeypatch):
    """commit() saves, then checks for host updates: a notice that arrives before every commit (issue 38:
    a stranger's write to elastic/notice) used to count each interrupted commit as progress, so the loop
    reset forever. Now it gives up after HVPS_ELASTIC_RESETS_WITHOUT_COMMIT resets."""
    monkeypatch.setenv("HVPS_ELASTIC_RESETS_WITHOUT_COMMIT", "3")
    resets = []

    def reset():
        resets.append(1)
        assert len(resets) < 50, "the loop never gives up"

    def train(state):
        notify_hosts_updated(time.time() + len(resets), HostUpdateResult.added)
        state.step += 1
        state.commit()

    with pytest.raises(hvps.HvpsError, match="gave up after 4 resets in a row with no completed commit"):
        run_fn(train, reset=reset)(_state(step=0))
    assert len(resets) == 3
    monkeypatch.setenv("HVPS_ELASTIC_RESETS_WITHOUT_COMMIT", "zero")
    with pytest.raises(hvps.HvpsError, match="HVPS_ELASTIC_RESETS_WITHOUT_COMMIT='zero'"):
        run_fn(train, reset=reset)(_state(step=0))


def test_elastic_mode_reads_hvps_elastic(monkeypatch):
    assert not elastic_mode()
    monkeypatch.setenv("HVPS_ELASTIC", "1")
    assert elastic_mode()
    monkeypatch.setenv("HVPS_ELASTIC", "yes")
    with pytest.raises(hvps.HvpsError, match="HVPS_ELASTIC='yes' is unknown; choose one of 0, 1"):
        elastic_mode()


@pytest.mark.parametrize("env, refused", [
    ({}, False),
    ({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, False),
    ({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}, True),
    ({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "1"}, True),
])
def test_torchrun_with_restarts_is_refused(monkeypatch, env, refused):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (torchrun_restarts() is not None) is refused
    wrapped = run_fn(lambda state: "ran", reset=lambda: None)
    if not refused:
        assert wrapped(_state(step=0)) == "ran"
        return
    with pytest.raises(hvps.HvpsError) as caught:
        wrapped(_state(step=0))
    for needle in ("torchrun restarts every worker from scratch", "--min-np", "--host-discovery-script"):
        assert needle in str(caught.value)


def test_partition_covers_what_is_left_once_over_any_size():
    from hvps.adapters.torch.elastic import partition

    processed = set(range(0, 41, 3))
    for size in (1, 2, 3, 5):
        shares = [partition(41, processed, 4, 11, True, rank, size) for rank in range(size)]
        remaining = shares[0][0]
        assert sorted(remaining) == sorted(set(range(41)) - processed)
        assert len({len(mine) for _, mine in shares}) == 1
        assert set().union(*[set(mine) for _, mine in shares]) == set(remaining)
        assert sum(len(mine) for _, mine in shares) - len(remaining) < size  # padding only to even out
    assert partition(10, (), 1, 0, True, 0, 1)[0] != partition(10, (), 2, 0, True, 0, 1)[0]  # a new order per epoch
    assert partition(10, (), 1, 0, True, 0, 1)[0] == partition(10, (), 1, 0, True, 0, 1)[0]
    assert partition(6, (), 0, 0, False, 1, 2)[1] == [1, 3, 5]
    assert partition(4, {0, 1, 2}, 0, 0, False, 2, 3) == ([3], [3])  # one left for three ranks: repeated
    assert partition(4, range(4), 0, 0, True, 0, 2) == ([], [])


def _rebuilt_blocks(numel: int, old_size: int, survivors: list, joiners: int, stride: int = 1) -> tuple:
    """Play the sharded recovery's data movement on lists: old rank r held block r and a copy of block
    r - stride; ``survivors`` (old ranks, in their new rank order) come first, then ``joiners`` empty ranks.
    Returns (what each new rank ends up with, what it should hold)."""
    from hvps.core.flat_shards import FlatLayout
    from hvps.elastic.shard_recovery import block_providers, copied_block, transfers

    flat = [float(i + 1) for i in range(numel)]
    old = FlatLayout((numel,), old_size)
    padded = flat + [0.0] * (old.padded - numel)
    own = {r: padded[slice(*old.block(r))] for r in range(old_size)}
    copies = {r: own[copied_block(r, old_size, stride)] for r in range(old_size)}
    holders = [(r, True) for r in survivors] + [None] * joiners
    new_size = len(holders)
    new = FlatLayout((numel,), new_size)
    got = [[0.0] * new.shard_numel for _ in range(new_size)]
    for move in transfers(numel, old_size, new_size, block_providers(holders, old_size, stride)):
        held_by = holders[move.source][0]
        source = copies[held_by] if move.from_copy else own[held_by]
        assert (copied_block(held_by, old_size, stride) if move.from_copy else held_by) == move.old_block
        got[move.dest][move.at : move.at + move.length] = source[move.offset : move.offset + move.length]
    wanted_padded = flat + [0.0] * (new.padded - numel)
    return got, [wanted_padded[slice(*new.block(j))] for j in range(new_size)]


def test_sharded_recovery_rebuilds_every_block_from_own_and_neighbour_copies():
    """Issue 39 item 5's arithmetic: any survivors of 1-4 ranks with no two ring neighbours dead, plus 0-2
    joiners, rebuild each new rank's block of the new layout exactly (padding zero), each element once."""
    import itertools

    cases = 0
    for old_size in range(1, 5):
        for dead_count in range(old_size):
            for dead in itertools.combinations(range(old_size), dead_count):
                if old_size > 1 and any((d + 1) % old_size in dead for d in dead):
                    continue  # a lost shard: the next test
                survivors = [r for r in range(old_size) if r not in dead]
                for joiners, numel in itertools.product(range(3), (1, 5, 7, 13)):
                    got, wanted = _rebuilt_blocks(numel, old_size, survivors, joiners)
                    assert got == wanted, (old_size, dead, joiners, numel)
                    cases += 1
    assert cases == (1 + 3 + 4 + 7) * 3 * 4  # survivor sets with no two neighbours dead at 1..4 ranks


def test_sharded_recovery_keeps_each_copy_on_the_next_host():
    """Several hosts with the same rank count: a block's copy is kept local_size ranks on (the same local rank
    on the next host), so losing a whole host (hvpsrun and Horovod blacklist a failed worker's host) loses
    nothing; with the copy on the next rank (stride 1) the same loss would lose a shard."""
    from hvps.core.errors import HvpsError
    from hvps.elastic.shard_recovery import block_providers, copy_stride

    assert copy_stride(8, 4, 2) == 4 and copy_stride(6, 2, 3) == 2
    assert copy_stride(4, 4, 1) == 1 and copy_stride(5, 2, 2) == 1 and copy_stride(1, 1, 1) == 1  # one host; uneven
    for hosts, per_host in ((2, 2), (3, 2), (2, 3), (3, 3)):
        size = hosts * per_host
        stride = copy_stride(size, per_host, hosts)
        for lost in range(hosts):
            survivors = [r for r in range(size) if r // per_host != lost]
            for joiners, numel in ((0, 11), (per_host, 29)):
                got, wanted = _rebuilt_blocks(numel, size, survivors, joiners, stride)
                assert got == wanted, (hosts, per_host, lost, joiners, numel)
        with pytest.raises(HvpsError, match="is lost"):
            block_providers([(r, True) for r in range(per_host, size)], size, 1)


def test_sharded_recovery_refuses_when_two_ring_neighbours_died():
    from hvps.core.errors import HvpsError
    from hvps.elastic.shard_recovery import block_providers

    with pytest.raises(HvpsError, match=r"the shard of old rank 1 \(of 3\) is lost: rank 1 and rank 2, which kept its "
                                        r"copy, are both gone .* restart from your checkpoint"):
        block_providers([(0, True), None], 3)
    with pytest.raises(HvpsError, match="claims old rank 0 of 2, which is out of range or claimed twice"):
        block_providers([(0, True), (0, True)], 2)
    with pytest.raises(HvpsError, match="the shard of old rank 1"):  # its keeper survived, but saved no copy
        block_providers([(2, False), (0, True)], 3)
    assert block_providers([(2, True), (0, False)], 3) == {0: (1, False), 1: (0, True), 2: (0, False)}
