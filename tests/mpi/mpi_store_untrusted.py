"""Inner multi-rank tests (tests/test_store_untrusted.py): the store's checkpoints read as untrusted
input.  Each test saves real versions (epochs 0 and 1), rank 0 plants one defect in epoch 1 the
way an attacker would (tests/store_forge.py recomputes the digests the change breaks), and every
rank then loads: the defect must be a CheckpointError on every rank together (``version=1``) or,
with ``"latest"``, a warning naming it on every rank and a fallback to epoch 0, with no row of any
table changed by the bad version.  Nothing may hang (FIFOs) or allocate what a file declares.

Some defects are planted again with HVPS_CHECKPOINT_KEY set (every rank, from the first save on):
a FIFO must not hang then either, and an edited optimizer state is refused even when the attacker
recomputed every digest, by the signature of the shard and of the dense file.
"""

import os
import resource
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hvps_testutil import shared_dir

import hvps.adapters.torch as hvd
from hvps.checkpoint.format import CheckpointError
from hvps.checkpoint.manager import CheckpointManager
from hvps.store import ShardedEmbeddingBag, load_stores, save_stores

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import store_forge as forge  # noqa: E402
from ckpt_forge import corrupt_global_heap  # noqa: E402

pytestmark = pytest.mark.timeout(90)

N, D = 61, 4
KEY = "store-untrusted-test-key-0123456789"
DEADLINE = float(os.environ.get("HVPS_CHECKPOINT_INSPECT_TIMEOUT", "10"))
SLACK = 20  # s on top of the inspection deadline: helper start-up on a loaded 2-core machine


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    torch.set_num_threads(1)
    yield


def _full_table(module):
    module.synchronize()
    t = module.table
    t.flush()
    ids = t.partition.global_ids(t.member, torch.arange(t.tier.rows))
    records = t.records(0, t.tier.rows).clone()
    full = torch.full((t.num_embeddings, t.width), float("nan"))
    full[hvd.allgather(ids)] = hvd.allgather(records)
    return full


def _train(module, seed, steps=2):
    g = torch.Generator().manual_seed(seed * 100 + hvd.rank())
    for _ in range(steps):
        module(torch.randint(0, N, (3, 2), generator=g)).sum().backward()
    module.synchronize()


class Versions:
    """Epochs 0 and 1 of table ``name`` saved in a fresh directory; then the module trains on."""

    def __init__(self, name, epochs=2, **storage):
        self.name = name
        self.directory = shared_dir(name)
        self.manager = CheckpointManager(self.directory, keep_last=None, fsync=False)
        self.module = ShardedEmbeddingBag(N, D, mode="sum", name=name, optimizer="adagrad", lr=0.1, **storage)
        self.tables, self.steps = [], []
        for epoch in range(epochs):
            _train(self.module, epoch)
            self.tables.append(_full_table(self.module))
            self.steps.append(self.module.table.optimizer.steps)
            save_stores(self.manager, epoch, [self.module], model={"w": np.full(2, epoch, np.float32)})
        _train(self.module, 99)  # the live table differs from every saved version
        self.live = _full_table(self.module)

    def shard(self, k=0, epoch=1):
        return forge.shards(self.directory, epoch, self.name)[k]

    def sabotage(self, plant):
        if hvd.rank() == 0:
            plant(self)
        hvd.barrier()

    def load_latest(self, match):
        """load_stores("latest") falls back to epoch 0 on every rank, warning with ``match``."""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert load_stores(self.manager, [self.module]) == 1
        elapsed = time.monotonic() - start
        skipped = [str(w.message) for w in caught if "skipping checkpoint epoch 1" in str(w.message)]
        assert len(skipped) == 1, [str(w.message) for w in caught]
        assert any(m in skipped[0] for m in match), (match, skipped[0])
        assert torch.equal(_full_table(self.module), self.tables[0])
        assert self.module.table.optimizer.steps == self.steps[0]
        assert self.manager.loaded.model["w"][0] == 0
        assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 200 << 10  # KiB
        assert elapsed < DEADLINE + SLACK
        return skipped[0]

    def load_exact(self, match):
        """load_stores(version=1) raises CheckpointError on every rank and changes no row."""
        self.module.table.optimizer.steps = 777
        live = _full_table(self.module)
        start = time.monotonic()
        with pytest.raises(CheckpointError) as info:
            load_stores(self.manager, [self.module], version=1)
        assert time.monotonic() - start < DEADLINE + SLACK
        assert any(m in str(info.value) for m in match), (match, str(info.value))
        assert torch.equal(_full_table(self.module), live)
        assert self.module.table.optimizer.steps == 777


# ----------------------------------------------------------------------------- the defects
def _fifo_shard(v):
    path = v.shard()
    path.unlink()
    os.mkfifo(path)


def _external_fifo(v):
    fifo = v.directory / "outside.fifo"
    os.mkfifo(fifo)
    forge.replace_records(v.shard(), external=[(str(fifo), 0, 1 << 20)])


def _manifest_to_fifo(v):
    fifo = v.directory / "elsewhere.fifo"
    os.mkfifo(fifo)

    def edit(m):
        m["tables"][v.name]["shards"][0]["file"] = str(fifo)  # absolute: Path joins it as it is
        return m

    forge.edit_store_manifest(v.directory, 1, edit)


def _manifest_escapes(v):
    outside = v.directory / "copy.h5"
    outside.write_bytes(v.shard().read_bytes())

    def edit(m):
        m["tables"][v.name]["shards"][0]["file"] = f"../{outside.name}"
        return m

    forge.edit_store_manifest(v.directory, 1, edit)


def _symlinked_shard(v):
    path, outside = v.shard(), v.directory / "copy.h5"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


def _hanging_heap(v):
    corrupt_global_heap(v.shard())


def _rows(v, k=0):
    return forge.store_manifest(v.directory, 1)["tables"][v.name]["shards"][k]["rows"]


def _absurd_shape(v):
    forge.replace_records(v.shard(), shape=(500, 2 ** 40), ids_rows=500)
    forge.rebless_store(v.directory, 1, v.name)


def _absurd_width(v):
    forge.replace_records(v.shard(), shape=(_rows(v), 2 ** 40))
    forge.rebless_store(v.directory, 1, v.name)


def _declares_2gib(v):
    path, rows = v.shard(), _rows(v)
    forge.replace_records(path, shape=(rows, (2 << 30) // (4 * rows) + 1))
    forge.rebless_store(v.directory, 1, v.name)
    assert path.stat().st_size < 64 << 10


def _tables_list(v):
    forge.edit_store_manifest(v.directory, 1, lambda m: dict(m, tables=[]))


def _missing_key(v):
    def edit(m):
        del m["tables"][v.name]["members"]
        return m

    forge.edit_store_manifest(v.directory, 1, edit)


def _steps_text(v):
    for path in forge.shards(v.directory, 1, v.name):
        forge.set_optimizer_attr(path, "steps", "x")
    forge.rebless_store(v.directory, 1, v.name)


def _steps_edited(v):
    for path in forge.shards(v.directory, 1, v.name):
        forge.set_optimizer_attr(path, "steps", 123456)


def _steps_forged(v):
    _steps_edited(v)
    forge.rebless_store(v.directory, 1, v.name)


_SIGNED = ("signature",)  # a forged chain, when a key is set
DEFECTS = {  # name: (plant, what the warning names without a key, with a key)
    "shard_fifo": (_fifo_shard, ("not a regular file",), None),
    "external_fifo": (_external_fifo, ("external storage",), None),
    "manifest_to_fifo": (_manifest_to_fifo, ("shards are files of their own folder",), _SIGNED),
    "manifest_escapes": (_manifest_escapes, ("shards are files of their own folder",), _SIGNED),
    "symlinked_shard": (_symlinked_shard, ("cannot be opened as a regular file",), None),
    "hanging_heap": (_hanging_heap, ("took over",), None),
    "absurd_shape": (_absurd_shape, ("declares", "rows"), _SIGNED),
    "absurd_width": (_absurd_width, ("declares",), _SIGNED),
    "declares_2gib": (_declares_2gib, ("declares",), _SIGNED),
    "tables_list": (_tables_list, ("tables: must be an object",), _SIGNED),
    "missing_key": (_missing_key, ("keys table, members, shards",), _SIGNED),
    "steps_text": (_steps_text, ("non-negative integer 'steps'",), _SIGNED),
    "steps_edited": (_steps_edited, ("attribute steps differs from the manifest",), None),
    "steps_forged": (_steps_forged, None, _SIGNED),  # without a key a full forgery is not detectable
}
EXACT = ("shard_fifo", "external_fifo", "manifest_to_fifo", "steps_text", "absurd_shape")


KEYED = ("shard_fifo", "external_fifo", "manifest_to_fifo", "steps_edited", "steps_forged")
PLANTED = [(name, False) for name, (_, unkeyed, _) in DEFECTS.items() if unkeyed] + [(name, True) for name in KEYED]


@pytest.mark.parametrize("name,keyed", PLANTED, ids=[f"{n}{'-key' if k else ''}" for n, k in PLANTED])
def test_defect_falls_back_on_every_rank(name, keyed, monkeypatch):
    plant, unkeyed, with_key = DEFECTS[name]
    match = (with_key or unkeyed) if keyed else unkeyed
    if keyed:
        monkeypatch.setenv("HVPS_CHECKPOINT_KEY", KEY)
    else:
        monkeypatch.delenv("HVPS_CHECKPOINT_KEY", raising=False)
    v = Versions(f"u_{name}{'_key' if keyed else ''}")
    v.sabotage(plant)
    v.load_latest(match)
    if name in EXACT:
        v.load_exact(match)


def test_external_storage_is_refused_before_the_other_file_is_read():
    v = Versions("u_external_file")
    secret = v.directory / "secret"

    def plant(v):
        secret.write_bytes(os.urandom(1 << 16))
        forge.replace_records(v.shard(), external=[(str(secret), 0, 1 << 16)])
        os.utime(secret, (0, time.time()))  # atime before mtime: any read now updates it (relatime)

    v.sabotage(plant)
    v.load_latest(("external storage",))
    assert secret.stat().st_atime == 0


def test_stray_folders_are_ignored_and_temporaries_removed():
    v = Versions("u_stray", epochs=1)
    kept = forge.folder_of(v.directory, 0)
    stray = [v.directory / "store-epoch-old", v.directory / "store-epoch-000002.bak"]
    temporaries = [kept / f".{v.name}.00000-of-{hvd.size():05d}.h5.tmp-99999-deadbeef",
                   kept / ".MANIFEST.json.tmp-99999-0badf00d",
                   forge.folder_of(v.directory, 1) / f".{v.name}.00001-of-{hvd.size():05d}.h5.tmp-99998-feedf00d"]
    if hvd.rank() == 0:
        for d in stray:
            d.mkdir()
            (d / "keep").write_text("not hvps's")
        for t in temporaries:
            t.parent.mkdir(exist_ok=True)
            t.write_bytes(b"\0" * 4096)
    hvd.barrier()
    save_stores(v.manager, 1, [v.module], model={"w": np.full(2, 1, np.float32)})
    hvd.barrier()
    assert all((d / "keep").exists() for d in stray)
    assert not any(t.exists() for t in temporaries)
    assert load_stores(v.manager, [v.module]) == 2


def test_disk_tier_falls_back_and_frees_its_spare(tmp_path):
    """A disk tier with a cache: the spare shard is a file in disk_dir, unlinked once mapped; the
    skipped version's spare is dropped, the good one's replaces the shard and the cache."""
    disk = tmp_path / f"rank{hvd.rank()}"
    v = Versions("u_disk", tier="disk", disk_dir=disk, cache_rows=5)
    v.sabotage(_steps_edited)
    v.load_latest(("attribute steps differs from the manifest",))
    assert list(disk.iterdir()) == []
    assert v.module.table.tier.kind == "disk" and v.module.table.cache.tier is v.module.table.tier


def test_reload_after_a_skipped_version_is_exact():
    """The skipped version left nothing behind: loading epoch 0 explicitly gives the same rows."""
    v = Versions("u_again")
    v.sabotage(_steps_edited)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_stores(v.manager, [v.module]) == 1
    _train(v.module, 5)
    assert load_stores(v.manager, [v.module], version=0) == 1
    assert torch.equal(_full_table(v.module), v.tables[0])
