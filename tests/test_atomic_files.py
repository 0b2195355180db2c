"""hvps.core.atomic_files: the one atomic, durable publish that checkpoint versions, store shards
and store manifests use, and the clean-up of what a killed writer leaves.

The rule (the two copies it replaced had drifted: the checkpoint manager left the file's fsync to
its writer, the store fsynced it itself): the file is fsynced before the rename, the folder after
it, and a failure leaves the published name as it was and no temporary file."""

from __future__ import annotations

import os
import stat

import pytest

from hvps.core.atomic_files import TEMPORARY_RE, atomic_publish, remove_temporaries, temporary_name


@pytest.fixture
def durability_log(monkeypatch):
    """Every fsync (of a file or a folder) and rename, in order; the real calls still run."""
    log = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        log.append(("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file",))
        return real_fsync(fd)

    def replace(src, dst):
        log.append(("rename", os.path.basename(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return log


def test_publish_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, durability_log):
    final = tmp_path / "ckpt-epoch-000001.h5"
    with atomic_publish(final) as tmp:
        assert tmp.parent == tmp_path and TEMPORARY_RE.match(tmp.name).group("final") == final.name
        tmp.write_text("new")  # a writer that does not fsync by itself
    assert final.read_text() == "new"
    assert durability_log == [("fsync-file",), ("rename", final.name), ("fsync-dir",)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]


def test_publish_without_fsync_only_renames(tmp_path, durability_log):
    final = tmp_path / "MANIFEST.json"
    with atomic_publish(final, fsync=False) as tmp:
        tmp.write_text("{}")
    assert durability_log == [("rename", final.name)]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, durability_log):
    final = tmp_path / "shard.h5"
    final.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_publish(final) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert final.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.h5"]
    assert durability_log == []


def test_remove_temporaries_takes_only_temporaries_of_the_names_asked_for(tmp_path):
    dead = [temporary_name(tmp_path / "ckpt-epoch-000003.h5"), temporary_name(tmp_path / "notes.txt")]
    keep = [tmp_path / "ckpt-epoch-000002.h5", tmp_path / ".hidden.tmp-x", tmp_path / "a.tmp-1-deadbeef"]
    for p in dead + keep:
        p.write_text("")
    assert remove_temporaries(tmp_path, publishes=lambda name: name.startswith("ckpt-epoch-")) == [dead[0]]
    assert remove_temporaries(tmp_path) == [dead[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in keep)
