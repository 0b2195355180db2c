"""Re-sharding between real jobs (issue 39, item 4), for tests/test_sharded_checkpoint.py (not collected by pytest).

``python reshard_job.py MODE DIR``, on the dyadic model of tests/mpi/dyadic_heads.py (its loss is linear in the
outputs, so every gradient and every Adam step is exact: see that module), with Adam over two parameter groups:

- ``save``: a 3-rank job trains two steps at stage 1-2 (``hvd.DistributedOptimizer(..., shard=True)``, 20-element
  buckets, uneven over 3 ranks) and at stage 3 (``hvd.fully_shard``, two units and the root), and saves each through
  ``hvd.CheckpointManager`` as epoch 1, in ``DIR/stage1-2`` and ``DIR/stage3``.
- ``load``: a job of any size loads each into the same kind (models shifted and a learning rate of 1 beforehand, so
  that whatever the load leaves out shows) and takes two more steps.
- ``plain``: one process, hvps never initialized (inference, export), loads each into an unsharded model and a plain
  ``torch.optim.Adam`` and takes two more steps.

Every mode trains the one-process run alongside, uninterrupted, and checks the parameters after every step bit for
bit against it, and at the end the optimizer state (the consolidated state at stage 1-2 and in one process, each
rank's slices at stage 3). Each rank prints ``RESHARD OK <mode> rank <r> of <n>`` once all of that held.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi"))
import dyadic_heads as dh  # noqa: E402
from hvps_testutil import assert_same_optimizer_state, shifted  # noqa: E402

import hvps  # noqa: E402
import hvps.adapters.torch as hvd  # noqa: E402
from hvps.adapters.torch.fully_sharded import FullyShardedModel, fully_shard  # noqa: E402
from hvps.adapters.torch.fully_sharded_checkpoint import Staged  # noqa: E402
from hvps.checkpoint.resharding import shard_bounds, source_pieces  # noqa: E402

SAVED_SIZE, SAVED_STEPS, MORE_STEPS = 3, 2, 2
LR = 2.0 ** -4
BUCKET_CAP_MB = 20 * 4 / 2**20  # 20 float32 elements


def build(name: str, mode: str, world: tuple) -> tuple:
    """``(model, optimizer)`` of run ``name`` ("stage1-2" or "stage3") for ``mode``; a loading one starts shifted, at
    a learning rate of 1 (the load must set both)."""
    model = dh.model() if mode == "save" else shifted(dh.model())
    lr = LR if mode == "save" else 1.0
    if mode == "plain":
        return model, dh.optimizer(model, "adam", lr)
    if name == "stage3":
        fully_shard(model, units=[model.first, model.second], broadcast_from=None)
        return model, dh.optimizer(model, "adam", lr)
    return model, hvd.DistributedOptimizer(dh.optimizer(model, "adam", lr), named_parameters=model.named_parameters(),
                                           shard=True, bucket_cap_mb=BUCKET_CAP_MB)


def main(mode: str, directory: Path) -> None:
    torch.set_num_threads(1)
    if mode != "plain":
        hvd.init()
    world = (hvd.size(), hvd.rank()) if mode != "plain" else (1, 0)
    assert mode != "save" or world[0] == SAVED_SIZE, f"the save job runs at {SAVED_SIZE} ranks, not {world[0]}"
    ref = dh.model()
    ref_opt = dh.optimizer(ref, "adam", LR)
    runs = {name: build(name, mode, world) for name in ("stage1-2", "stage3")}
    first, last = 0, SAVED_STEPS
    if mode != "save":
        dh.sharded_steps(ref, ref_opt, 0, SAVED_STEPS, 1, 0)
        first, last = SAVED_STEPS, SAVED_STEPS + MORE_STEPS
        for name, (model, opt) in runs.items():
            loaded = hvd.CheckpointManager(directory / name).load(model=model, optimizer=opt)
            assert loaded == SAVED_STEPS, f"{name}: load gave epoch {loaded}"
    fully_sharded = {name for name in runs if name == "stage3" and mode != "plain"}
    for step in range(first, last):
        dh.sharded_steps(ref, ref_opt, step, step + 1, 1, 0)
        for name, (model, opt) in runs.items():
            dh.sharded_steps(model, opt, step, step + 1, *world)
            full = dh.full(model) if name in fully_sharded else model.state_dict()
            dh.assert_equal(full, ref, f"{name}, {SAVED_SIZE} -> {world[0]} ranks ({mode}), step {step}")
    for name, (model, opt) in runs.items():
        if name in fully_sharded:  # each rank's blocks and Adam state: its slices of the reference's
            groups = FullyShardedModel.of(model).flat_groups()
            live = Staged([g.shard_flat for g in groups], opt.state_dict(), {})
            dh.assert_staged_is_the_reference_slice(live, model, opt, ref, ref_opt, *world)
            if mode == "load":  # the test reads across saved shards: some rank's block straddles two
                assert any(len(source_pieces(*shard_bounds(g.numel, world[0], q), g.numel, SAVED_SIZE)) > 1
                           for g in groups for q in range(world[0]))
        else:
            assert_same_optimizer_state(opt.state_dict(), ref_opt.state_dict())  # consolidated (collective at stage 1-2)
        if mode == "save":
            hvd.CheckpointManager(directory / name, fsync=False).save(SAVED_STEPS - 1, model=model, optimizer=opt)
    assert hvps.is_initialized() == (mode != "plain")
    print(f"RESHARD OK {mode} rank {world[1]} of {world[0]}", flush=True)
    if mode != "plain":
        hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
