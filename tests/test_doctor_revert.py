"""``hvps doctor --apply/--revert`` against a planted or tampered record: no command runs, nothing
outside the allow-listed settings is written, ``--root`` is not escaped (``..``, symlinks), the
temporary file cannot be redirected, and a record of another user or writable by others is refused."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from hvps import cli
from hvps.doctor import Host
from hvps.doctor.apply import apply, revert
from hvps.doctor.record import RecordError, check_step, load

THP = "sys/kernel/mm/transparent_hugepage"
ATTACKER = "hvps-doctor-attacker"


class Out:
    def __init__(self) -> None:
        self.lines: list = []

    def write(self, text: str) -> None:
        self.lines.append(text)

    @property
    def text(self) -> str:
        return "".join(self.lines)


def tree(root: Path) -> Path:
    """A --root tree with THP at 'always' (what --apply thp changes) and no GPU."""
    (root / THP).mkdir(parents=True)
    (root / THP / "enabled").write_text("[always] madvise never\n")
    (root / THP / "defrag").write_text("[always] defer defer+madvise madvise never\n")
    (root / "hvps-doctor-facts.json").write_text("{}")
    return root


def record(path: Path, steps: list) -> Path:
    path.write_text(json.dumps({"hvps_doctor_state": 1, "changes": steps}))
    os.chmod(path, 0o644)
    return path


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def victim(path: Path, text: str = "secret\n") -> Path:
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


GOOD = {"action": "thp", "kind": "write", "path": f"/{THP}/enabled", "before": "always", "after": "madvise"}


@pytest.mark.unit
def test_a_planted_record_runs_no_command(tmp_path):
    """The audit's attack: a record whose undo is a command line made root's --revert run it."""
    proof = tmp_path / "proof"
    shell = ["sh", "-c", f"id > {proof}"]
    planted = record(tmp_path / "planted.json", [{"action": "persistence", "kind": "command", "do": shell,
                                                   "undo": shell}])
    out = Out()
    assert revert(Host("/"), planted, out=out) == 2
    assert not proof.exists(), f"the planted command ran: {proof.read_text()}"
    assert "refusing --revert" in out.text and "no command lines" in out.text and planted.exists()
    for step in ({"action": "persistence", "kind": "nvidia-smi", "gpu": "0; id", "before": 1, "after": 0},
                 {"action": "persistence", "kind": "nvidia-smi", "gpu": 0, "before": True, "after": 0},
                 {"action": "persistence", "kind": "command", "do": ["nvidia-smi", "-i", "0", "-pm", "1", ";id"],
                  "undo": ["nvidia-smi", "-i", "0", "-pm", "0"]}):
        with pytest.raises(RecordError):
            check_step(step)
    legacy = {"action": "persistence", "kind": "command", "do": ["nvidia-smi", "-i", "2", "-pm", "1"],
              "undo": ["nvidia-smi", "-i", "2", "-pm", "0"]}  # written by the earlier --apply: still revertible
    assert check_step(legacy) == {"action": "persistence", "kind": "nvidia-smi", "gpu": 2, "before": 0, "after": 1}


@pytest.mark.unit
def test_a_record_writing_any_content_to_any_path_is_refused(tmp_path):
    target = victim(tmp_path / "victim")
    for step in (dict(GOOD, path=str(target), before="pwned"),                       # any path
                 dict(GOOD, before="pwned\nwith lines"),                             # any content
                 dict(GOOD, path="/proc/sys/kernel/core_pattern", before="|/tmp/x"),
                 dict(GOOD, action="governor", path="/sys/devices/system/cpu/cpu0/cpufreq/../../../../../x"),
                 dict(GOOD, extra="field")):
        planted = record(tmp_path / "planted.json", [GOOD, step])
        assert revert(Host("/"), planted, out=Out()) == 2, step
        assert target.read_text() == "secret\n"
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(RecordError, match="not an hvps doctor record"):
        load(tmp_path / "x.json")


@pytest.mark.unit
def test_dotdot_does_not_escape_root(tmp_path):
    root = tree(tmp_path / "t")
    target = victim(tmp_path / "victim")
    planted = record(tmp_path / "planted.json", [dict(GOOD, path="/../victim", before="pwned")])
    assert revert(Host(str(root)), planted, out=Out()) == 2
    assert target.read_text() == "secret\n"
    with pytest.raises(PermissionError, match="'..'"):
        Host(str(root)).write("/../victim", "pwned")
    assert target.read_text() == "secret\n"


@pytest.mark.unit
def test_in_tree_symlinks_are_not_followed_out_of_root(tmp_path):
    # a symlinked file: --revert of an allow-listed path
    root = tree(tmp_path / "t")
    target = victim(tmp_path / "victim", "always [madvise] never\n")
    (root / THP / "enabled").unlink()
    (root / THP / "enabled").symlink_to(target)
    out = Out()
    assert revert(Host(str(root)), record(tmp_path / "r.json", [GOOD]), out=out) == 1
    assert target.read_text() == "always [madvise] never\n" and "cannot write" in out.text
    # a symlinked folder: --apply plans and writes through it
    root2 = tree(tmp_path / "t2")
    outside = tmp_path / "outside"
    shutil.move(str(root2 / THP), outside)
    (root2 / THP).symlink_to(outside)
    before = snapshot(outside)
    state = tmp_path / "s2" / "doctor-state.json"
    assert apply(Host(str(root2)), ["thp"], state, yes=True, out=Out()) == 1
    assert snapshot(outside) == before
    # the fake root's command log
    root3 = tree(tmp_path / "t3")
    (root3 / "hvps-doctor-facts.json").write_text(json.dumps(
        {"gpu": {"gpus": [{"index": 0, "persistence": False}]}}))
    log = victim(tmp_path / "log-victim")
    (root3 / "commands.log").symlink_to(log)
    assert apply(Host(str(root3)), ["persistence"], tmp_path / "s3" / "doctor-state.json", yes=True, out=Out()) == 1
    assert log.read_text() == "secret\n"
    # the tree's var/lib, where the record goes by default
    root4 = tree(tmp_path / "t4")
    (root4 / "var").mkdir()
    (root4 / "var" / "lib").symlink_to(outside)
    before = snapshot(outside)
    assert cli.main(["doctor", "--root", str(root4), "--apply", "thp", "--yes"]) == 2
    assert snapshot(outside) == before and (root4 / THP / "enabled").read_text() == "[always] madvise never\n"


@pytest.mark.unit
def test_the_temporary_file_cannot_be_redirected(tmp_path):
    """The fixed name doctor-state.tmp, made a symlink, let root's --apply overwrite the file it points at."""
    root = tree(tmp_path / "t")
    secret = victim(tmp_path / "root-only")
    folder = tmp_path / "state"
    folder.mkdir()
    os.chmod(folder, 0o1777)  # a shared folder, as /tmp is
    (folder / "doctor-state.tmp").symlink_to(secret)
    state = folder / "doctor-state.json"
    assert apply(Host(str(root)), ["thp"], state, yes=True, out=Out()) == 0
    assert secret.read_text() == "secret\n"
    assert not state.is_symlink() and (state.stat().st_mode & 0o777) == 0o600
    assert [s["action"] for s in load(state)] == ["thp", "thp"]
    assert sorted(p.name for p in folder.iterdir()) == ["doctor-state.json", "doctor-state.tmp"]
    assert revert(Host(str(root)), state, out=Out()) == 0 and not state.exists()
    assert (root / THP / "enabled").read_text() == "[always] madvise never\n"


@pytest.fixture(scope="module")
def attacker():
    """A second local user (we run as root in this environment)."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd")
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                          capture_output=True, text=True)
    if made.returncode not in (0, 9):  # 9: already there
        pytest.fail(f"useradd: {made.stderr}")
    try:
        yield pwd.getpwnam(ATTACKER)
    finally:
        if made.returncode == 0:
            subprocess.run(["userdel", ATTACKER], capture_output=True)


def test_a_record_of_another_user_or_writable_by_others_is_refused(tmp_path, attacker, capsys):
    root = tree(tmp_path / "t")
    before = snapshot(root)
    applied = dict(GOOD, before="madvise", after="always")  # undo would put 'madvise' back
    planted = record(tmp_path / "planted.json", [applied])
    os.chown(planted, attacker.pw_uid, attacker.pw_gid)
    out = Out()
    assert revert(Host(str(root)), planted, out=out) == 2
    assert f"belongs to user {attacker.pw_uid}" in out.text and snapshot(root) == before
    os.chown(planted, 0, 0)
    for mode in (0o664, 0o646, 0o666):
        os.chmod(planted, mode)
        out = Out()
        assert revert(Host(str(root)), planted, out=out) == 2, oct(mode)
        assert "writable by group or others" in out.text and snapshot(root) == before
    link = tmp_path / "link.json"
    link.symlink_to(planted)
    os.chmod(planted, 0o644)
    assert revert(Host(str(root)), link, out=Out()) == 2 and snapshot(root) == before
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo, 0o644)
    assert revert(Host(str(root)), fifo, out=Out()) == 2  # refused at once, not blocked in open()
    # the same record, this user's and 0644: reverted
    assert cli.main(["doctor", "--root", str(root), "--revert", "--state", str(planted)]) == 0
    assert "every recorded change reverted" in capsys.readouterr().out
    assert (root / THP / "enabled").read_text() == "always [madvise] never\n"
