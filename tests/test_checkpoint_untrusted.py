"""Checkpoints as input from someone else: each defect an audit found ends in a
CheckpointError naming it, `load("latest")` falls back, and `hvps ckpt` prints
nothing raw."""

import os
import resource

import h5py
import numpy as np
import pytest
from ckpt_forge import entry, make_versions, path_of, replace_dataset, rewrite_manifest

from hvps import cli
from hvps.checkpoint.format import CheckpointError
from hvps.checkpoint.inspect import read_header, verify_file

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def versions(tmp_path):
    return make_versions(tmp_path)


def _refused(path, match):
    with pytest.raises(CheckpointError, match=match):
        verify_file(path)


def test_external_storage_is_refused(versions, tmp_path):
    secret = tmp_path / "passwd"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 8)
    replace_dataset(path_of(tmp_path, 2), "/model/w", (64,), np.float32, external=[(str(secret), 0, 256)])
    _refused(path_of(tmp_path, 2), "external storage")


def test_external_fifo_does_not_hang(versions, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    replace_dataset(path_of(tmp_path, 2), "/model/w", (64,), np.float32, external=[(str(fifo), 0, 256)])
    assert cli.main(["ckpt", "verify", str(tmp_path), "--epoch", "2"]) == 1  # pytest-timeout: no hang


def test_virtual_dataset_is_refused(versions, tmp_path):
    layout = h5py.VirtualLayout(shape=(64,), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(path_of(tmp_path, 1)), "/model/w", shape=(64,))
    with h5py.File(path_of(tmp_path, 2), "r+") as f:
        del f["/model/w"]
        f.create_virtual_dataset("/model/w", layout)
    _refused(path_of(tmp_path, 2), "virtual dataset")


@pytest.mark.parametrize("gib", [2, 64])
def test_declared_but_unallocated_gigabytes(versions, tmp_path, gib):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    replace_dataset(path_of(tmp_path, 2), "/model/w", (gib << 28,), np.float32)  # never written
    assert path_of(tmp_path, 2).stat().st_size < 1 << 20
    _refused(path_of(tmp_path, 2), "declares .* bytes but the file stores 0")
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 200 << 10  # KiB


@pytest.mark.parametrize("edit, match", [
    (lambda m: dict(m, datasets={"a": 1}), "datasets: must be a list"),
    (lambda m: [m], "must be a JSON object"),
    (lambda m: (entry(m, "/model/w").update(shape=5), m)[1], "shape must be a list"),
    (lambda m: (entry(m, "/model/w").update(nbytes=1 << 40), m)[1], "nbytes"),
    (lambda m: (entry(m, "/model/w").update(path="/../etc"), m)[1], "not /<section>/<name>"),
    (lambda m: dict(m, root=dict(m["root"], epoch="2")), "root.epoch"),
    (lambda m: dict(m, groups=[]), "groups: must be an object"),
])
def test_manifest_schema(versions, tmp_path, edit, match):
    with h5py.File(path_of(tmp_path, 2), "r+") as f:
        rewrite_manifest(f, edit)
    _refused(path_of(tmp_path, 2), match)


def test_datetime_dtype_is_refused(versions, tmp_path):
    with h5py.File(path_of(tmp_path, 2), "r+") as f:  # int64 bytes declared as datetime64
        rewrite_manifest(f, lambda m: (entry(m, "/model/b").update(dtype="datetime64[ns]"), m)[1])
    _refused(path_of(tmp_path, 2), "dtype 'datetime64\\[ns\\]' is not allowed")


def test_latest_falls_back_with_the_reason(versions, tmp_path, capsys):
    with h5py.File(path_of(tmp_path, 2), "r+") as f:
        rewrite_manifest(f, lambda m: dict(m, datasets={"a": 1}))
    with pytest.warns(RuntimeWarning, match="datasets: must be a list"):
        assert versions.load("latest") == 2  # epoch 1 + 1
    assert versions.loaded.epoch == 1
    assert cli.main(["ckpt", "list", str(tmp_path)]) == 1  # no traceback
    assert "datasets: must be a list" in capsys.readouterr().out


def test_keyed_signature(tmp_path, monkeypatch):
    monkeypatch.setenv("HVPS_CHECKPOINT_KEY", "k" * 32)
    make_versions(tmp_path, epochs=(1,))
    verify_file(path_of(tmp_path, 1))
    monkeypatch.setenv("HVPS_CHECKPOINT_KEY", "another key")
    _refused(path_of(tmp_path, 1), "signature does not match")
    monkeypatch.setenv("HVPS_CHECKPOINT_KEY", "k" * 32)
    with h5py.File(path_of(tmp_path, 1), "r+") as f:  # edited, the checksum recomputed
        rewrite_manifest(f, lambda m: dict(m, root=dict(m["root"], step=7)))
    _refused(path_of(tmp_path, 1), "signature does not match")
    monkeypatch.delenv("HVPS_CHECKPOINT_KEY")
    make_versions(tmp_path / "u", epochs=(1,))
    monkeypatch.setenv("HVPS_CHECKPOINT_KEY", "k" * 32)
    _refused(path_of(tmp_path / "u", 1), "no manifest signature")


def test_inspect_escapes_control_characters(versions, tmp_path, capsys):
    evil = "\x1b]0;owned\x07\x1b[2J"
    with h5py.File(path_of(tmp_path, 2), "r+") as f:
        f.attrs["framework"] = evil
        rewrite_manifest(f, lambda m: dict(m, root=dict(m["root"], framework=evil)))
    assert read_header(path_of(tmp_path, 2)).attrs["framework"] == evil
    assert cli.main(["ckpt", "inspect", str(tmp_path), "--epoch", "2"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;owned\\x07" in out


def test_file_swapped_for_a_fifo_after_inspection_is_refused(versions, tmp_path):
    """The reader opens by path again after the helper inspected the file: a FIFO put there in
    between is refused at once, not waited on."""
    from hvps.checkpoint.format import Reader

    path = path_of(tmp_path, 2)
    header = read_header(path)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        Reader(path, header).read()  # pytest-timeout: no hang
