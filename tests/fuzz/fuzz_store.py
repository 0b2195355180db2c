"""Fuzz store checkpoint reading: mutated shard files and store manifests through the checks a
load runs on each rank (read_store_manifest, then stage_table for every table). Anything but a
CheckpointError (or a clean load) is a crash.

    python tests/fuzz/fuzz_store.py --seeds CORPUS_DIR VERSION_DIR       (a version and inputs from it)
    python tests/fuzz/fuzz_store.py CORPUS_DIR -max_total_time=10        (atheris / libFuzzer)
    python tests/fuzz/fuzz_store.py --random CORPUS_DIR SECONDS           (byte mutation, no atheris)
    python tests/fuzz/fuzz_store.py --replay DEADLINE FILE...             (through the helper)
    python tests/fuzz/fuzz_store.py --inprocess FILE                      (one input, as the fuzzer ran it)

An input's first byte chooses what it replaces in a real version saved by two members (table
``t``, 40 x 4, Adagrad; in $FUZZ_STORE_VERSION, written by ``--seeds``): even, shard 0 of 2 (the
rest of the input is the file); odd, the store manifest. A replaced shard is listed in the store
manifest under its own manifest digest when that can be read, as an attacker who rewrites the
manifest would, so the checks behind the digest (the shard's structure, its rows, their bytes)
are reached too. Bit 1 of the first byte chooses who loads it: the single member of a
one-member table (re-sharding: every shard and every row is read) or member 0 of two (its own
shard only).

Metadata is inspected in this process while fuzzing with atheris (HVPS_CHECKPOINT_INSPECT_TIMEOUT=0),
as in fuzz_checkpoint.py; ``--replay`` feeds what hung or crashed libhdf5 through the helper process.
Random mode, which has no libFuzzer to survive a hang, inspects through the helper (2 s deadline).
Prints ``fuzz: N inputs, C crashes`` at the end in random mode.
"""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

EPOCH, ROWS, DIM, MEMBERS = 1, 40, 4, 2
_BASE = Path(tempfile.mkdtemp(prefix="hvps-fuzz-store-"))
_FOLDER = _BASE / f"store-epoch-{EPOCH:06d}"
_ORIGINAL = Path(os.environ.get("FUZZ_STORE_VERSION", _BASE / "original"))
_STATE: dict = {}


def _table(member: int, members: int):
    from hvps.store.optim import make_optimizer
    from hvps.store.table import ShardedTable, StoreOptions

    return ShardedTable("t", ROWS, DIM, make_optimizer("adagrad", 0.1), StoreOptions(), member, members)


def make_version(folder: Path) -> None:
    """A real version of table ``t`` saved by two members (as save_stores writes it)."""
    from hvps.store.checkpoint import MANIFEST, manifest_text, shard_name, write_shard

    folder.mkdir(parents=True, exist_ok=True)
    gathered = []
    for member in range(MEMBERS):
        table = _table(member, MEMBERS)
        table.optimizer.steps = 3
        entry = write_shard(folder / shard_name("t", member, MEMBERS), table, EPOCH, fsync=False)
        gathered.append({"t": dict(entry, table=table.describe(), members=MEMBERS)})
    (folder / MANIFEST).write_text(manifest_text(EPOCH, gathered))


def seeds(corpus: str, version: str) -> None:
    """Write a version to ``version`` and the two seed inputs made from it to ``corpus``."""
    from hvps.store.checkpoint import MANIFEST, shard_name

    make_version(Path(version))
    Path(corpus).mkdir(parents=True, exist_ok=True)
    shard = (Path(version) / shard_name("t", 0, MEMBERS)).read_bytes()
    manifest = (Path(version) / MANIFEST).read_bytes()
    for name, first, data in (("shard0", 0, shard), ("manifest", 1, manifest), ("shard0-own", 2, shard),
                              ("manifest-own", 3, manifest)):
        (Path(corpus) / name).write_bytes(bytes([first]) + data)


def _setup() -> None:
    if not _STATE:
        if not _ORIGINAL.exists():
            make_version(_ORIGINAL)
        _STATE["tables"] = [_table(0, 1), _table(0, MEMBERS)]


def one_input(data: bytes):
    """Put ``data`` in place of a shard or the manifest and check the version as a load does."""
    from hvps.checkpoint.format import CheckpointError
    from hvps.checkpoint.inspect import inspect_header
    from hvps.store.checkpoint import MANIFEST, read_store_manifest, shard_name, stage_table
    from hvps.store.tiers import discard_tier

    _setup()
    if _FOLDER.exists():
        shutil.rmtree(_FOLDER)
    shutil.copytree(_ORIGINAL, _FOLDER)
    if not data:
        return None
    if data[0] % 2 == 0:
        shard = _FOLDER / shard_name("t", 0, MEMBERS)
        shard.write_bytes(data[1:])
        try:
            digest = inspect_header(shard).manifest_sha256
        except CheckpointError:
            digest = None
        if digest:
            manifest = json.loads((_FOLDER / MANIFEST).read_text())
            manifest["tables"]["t"]["shards"][0]["sha256"] = digest
            (_FOLDER / MANIFEST).write_text(json.dumps(manifest))
    else:
        (_FOLDER / MANIFEST).write_bytes(data[1:])
    try:
        _, manifest = read_store_manifest(_FOLDER, EPOCH)
        if "t" in manifest["tables"]:
            table = _STATE["tables"][(data[0] >> 1) % 2]
            tier, _ = stage_table(_FOLDER, table, manifest["tables"]["t"], EPOCH)
            discard_tier(tier)
    except CheckpointError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    if sys.argv[1] == "--seeds":
        seeds(sys.argv[2], sys.argv[3])
        sys.exit(0)
    if sys.argv[1] == "--replay":
        sys.exit(driver.replay(one_input, sys.argv[2], sys.argv[3:]))
    if sys.argv[1] == "--random":  # no libFuzzer to survive a hang: inspect through the helper
        os.environ["HVPS_CHECKPOINT_INSPECT_TIMEOUT"] = "2"
        sys.exit(driver.random_mode(one_input, sys.argv[2], float(sys.argv[3]), keep=1))  # byte 0 picks the target
    os.environ["HVPS_CHECKPOINT_INSPECT_TIMEOUT"] = "0"
    if sys.argv[1] == "--inprocess":
        driver.in_process(one_input, sys.argv[2])
        sys.exit(0)
    driver.atheris_mode(one_input, sys.argv, ["hvps.checkpoint.format", "hvps.checkpoint.safety",
                                              "hvps.store.checkpoint"])
