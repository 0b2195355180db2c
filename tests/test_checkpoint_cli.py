"""``hvps ckpt list|inspect|verify|rollback`` (in process through hvps.cli.main, and once
through the installed console script)."""

import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hvps import cli
from hvps.checkpoint.manager import CheckpointManager, file_name
from hvps.checkpoint.versions import CheckpointVersions


@pytest.fixture
def ckdir(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=10)
    for e in range(3):
        mgr.save(e, model={"w": np.full(5000, e, np.float32)}, optimizer={"param_groups": [{"lr": 0.1}]}, step=e * 10)
    return tmp_path


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def flip(path):
    with h5py.File(path, "r") as f:
        off = f["model/w"].id.get_offset()
    with open(path, "r+b") as fh:
        fh.seek(off + 10)
        fh.write(b"\xff")


def test_list_text_and_json(ckdir, capsys):
    rc, out, _ = run(capsys, "ckpt", "list", str(ckdir))
    assert rc == 0
    lines = out.splitlines()
    assert "3 version(s)" in lines[0]
    assert lines[1].split()[:3] == ["epoch", "step", "size"]
    assert [ln.split()[0] for ln in lines[2:5]] == ["0", "1", "2"]
    assert lines[4].split()[1] == "20" and lines[4].rstrip().endswith("readable")
    rc, out, _ = run(capsys, "ckpt", "list", str(ckdir), "--json")
    data = json.loads(out)
    assert rc == 0 and [v["epoch"] for v in data["versions"]] == [0, 1, 2]
    assert data["versions"][2]["step"] == 20 and data["versions"][2]["world_size"] == 1


def test_list_verify_flags_bad_version(ckdir, capsys):
    flip(ckdir / file_name(1))
    rc, out, _ = run(capsys, "ckpt", "list", str(ckdir))
    assert rc == 0  # headers are intact
    rc, out, _ = run(capsys, "ckpt", "list", str(ckdir), "--verify", "--json")
    data = json.loads(out)
    assert rc == 1
    assert [v["status"] for v in data["versions"]] == ["verified", "BAD", "verified"]
    assert "checksum mismatch" in data["versions"][1]["error"]


def test_verify(ckdir, capsys):
    rc, out, _ = run(capsys, "ckpt", "verify", str(ckdir))
    assert rc == 0 and "3 of 3 verified" in out and out.count("OK ") == 3
    flip(ckdir / file_name(2))
    rc, out, _ = run(capsys, "ckpt", "verify", str(ckdir))
    assert rc == 1 and "2 of 3 verified" in out and f"BAD {ckdir / file_name(2)}" in out
    assert "/model/w" in out
    rc, out, _ = run(capsys, "ckpt", "verify", str(ckdir), "--epoch", "0", "--json")
    data = json.loads(out)
    assert rc == 0 and data["ok"] and data["results"][0]["epoch"] == 0


def test_inspect(ckdir, capsys):
    rc, out, _ = run(capsys, "ckpt", "inspect", str(ckdir), "--datasets")
    assert rc == 0
    assert str(ckdir / file_name(2)) in out.splitlines()[0]
    assert "epoch              2" in out and "/model/w" in out and "float32" in out
    assert 'attr /optimizer/param_groups = [{"lr": 0.1}]' in out
    rc, out, _ = run(capsys, "ckpt", "inspect", str(ckdir), "--epoch", "1", "--json")
    data = json.loads(out)
    assert data["epoch"] == 1 and data["datasets"] == 1 and data["sections"]["model"]["bytes"] == 20000
    rc, out, err = run(capsys, "ckpt", "inspect", str(ckdir), "--epoch", "9")
    assert rc == 1 and "ckpt-epoch-000009.h5: no such checkpoint file" in err


def test_rollback_and_undo(ckdir, capsys):
    rc, out, _ = run(capsys, "ckpt", "rollback", str(ckdir), "--to", "0")
    assert rc == 0 and "2 version(s) moved to the attic" in out
    assert [v.epoch for v in CheckpointManager(ckdir).list()] == [0]
    rc, out, _ = run(capsys, "ckpt", "list", str(ckdir))
    assert "attic: 1 rollback(s)" in out
    rc, out, _ = run(capsys, "ckpt", "rollback", str(ckdir), "--undo", "--json")
    data = json.loads(out)
    assert rc == 0 and data["undo"] and len(data["moved"]) == 2
    assert [v.epoch for v in CheckpointManager(ckdir).list()] == [0, 1, 2]
    rc, out, err = run(capsys, "ckpt", "rollback", str(ckdir), "--undo")
    assert rc == 1 and "nothing to undo" in err


def test_bad_flags_say_what_to_do(ckdir, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["ckpt", "list", str(ckdir), "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in err and "--help" in err
    with pytest.raises(SystemExit):
        cli.main(["ckpt", "list"])
    assert "required: DIR" in capsys.readouterr().err
    rc, _, err = run(capsys, "ckpt", "rollback", str(ckdir))
    assert rc == 2 and "give either --to EPOCH or --undo" in err


def test_help_explains_every_flag(capsys):
    for action, flags in {"list": ["--json", "--verify"], "inspect": ["--epoch", "--datasets", "--json"],
                          "verify": ["--epoch", "--json"], "rollback": ["--to", "--undo", "--force", "--json"]}.items():
        with pytest.raises(SystemExit) as exc:
            cli.main(["ckpt", action, "--help"])
        assert exc.value.code == 0
        out = capsys.readouterr().out
        for flag in flags:
            assert flag in out, (action, flag)


def test_registry_allows_more_subcommands(monkeypatch):
    def register(sub):
        p = sub.add_parser("zz-test", help="test")
        p.set_defaults(func=lambda args: 7)

    monkeypatch.setitem(cli.SUBCOMMANDS, "zz-test", register)
    assert cli.main(["zz-test"]) == 7
    assert set(cli.SUBCOMMANDS) >= {"ckpt", "doctor"}


def test_console_script(ckdir):
    exe = shutil.which("hvps", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert exe, "the hvps console script is not installed (pip install -e .)"
    res = subprocess.run([exe, "ckpt", "verify", str(ckdir), "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ok"] is True


def test_inspect_of_a_fifo_is_refused_at_once(ckdir, capsys):
    """Issue 38: ``hvps ckpt inspect`` on a FIFO took 10.8 s, said "corrupt HDF5?" and printed BrokenPipeError
    tracebacks. It is refused at once, naming what it is."""
    import os
    import time

    (ckdir / file_name(2)).unlink()
    os.mkfifo(ckdir / file_name(2))
    began = time.monotonic()
    rc, out, err = run(capsys, "ckpt", "inspect", str(ckdir), "--epoch", "2")
    assert rc == 1 and "is not a regular file (a FIFO, device or directory?)" in err, err
    assert "Traceback" not in err and "corrupt HDF5" not in err, err
    assert time.monotonic() - began < 5


def test_versions_alone_list_and_roll_back_what_the_manager_saved(tmp_path):
    """CheckpointVersions, the one-process half the CLI uses, on its own: the manager's methods of
    the same names are its delegations."""
    mgr = CheckpointManager(tmp_path, keep_last=10)
    for epoch in range(3):
        mgr.save(epoch, model={"w": np.full(4, epoch, np.float32)})
    versions = CheckpointVersions(tmp_path)
    assert [v.epoch for v in versions.list()] == [v.epoch for v in mgr.list()] == [0, 1, 2]
    assert versions.latest().epoch == 2 and versions.verify(1).epoch == 1
    moved = versions.rollback(0)
    assert [p.name for p in moved] == [file_name(1), file_name(2)] and mgr.rollbacks() == versions.rollbacks()
    assert [v.epoch for v in mgr.list()] == [0]
    assert [p.name for p in mgr.undo_rollback()] == [file_name(1), file_name(2)]
    assert [v.epoch for v in versions.list()] == [0, 1, 2]
