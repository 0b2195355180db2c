"""hvps.core.files: the one rule by which hvps opens a file it did not write (hostfiles, secrets,
checkpoints, the doctor's record)."""

import os

import pytest

from hvps.core.files import RefusedFile, open_untrusted, read_untrusted

pytestmark = pytest.mark.unit


def test_a_regular_file_passes_and_its_descriptor_blocks(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"abc\n")
    fd = open_untrusted(good, follow_links=False, own=True, forbidden_mode=0o022, max_bytes=4)
    try:
        assert os.get_blocking(fd) and os.read(fd, 10) == b"abc\n"
    finally:
        os.close(fd)
    assert read_untrusted(good, 2) == b"ab"


def test_every_check_refuses_with_its_reason(tmp_path):
    good = tmp_path / "good"
    good.write_bytes(b"x" * 10)
    good.chmod(0o644)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening it blocking would hang: refused at once
    link = tmp_path / "link"
    link.symlink_to(good)
    cases = [
        (tmp_path / "none", {}, "does not exist"),
        (fifo, {}, "is not a regular file"),
        (tmp_path, {}, "is not a regular file"),
        (link, {"follow_links": False}, "a symlink is refused"),
        (good, {"forbidden_mode": 0o077}, r"may be read or written by others \(mode -rw-r--r--\)"),
        (good, {"max_bytes": 9}, "holds 10 bytes, more than the 9 accepted"),
    ]
    for path, checks, reason in cases:
        with pytest.raises(RefusedFile, match=reason) as caught:
            open_untrusted(path, **checks)
        assert caught.value.missing == (reason == "does not exist")
    good.chmod(0o664)
    with pytest.raises(RefusedFile, match="is writable by group or others"):
        read_untrusted(good, 4, forbidden_mode=0o022)
    assert read_untrusted(link, 1) == b"x"  # links are followed unless refused
    if os.geteuid() == 0:
        os.chown(good, 65534, -1)
        with pytest.raises(RefusedFile, match="belongs to user 65534"):
            open_untrusted(good, own=True)
