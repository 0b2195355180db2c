"""A checkpoint whose corrupt HDF5 global heap makes libhdf5 loop forever in C: the
helper process of hvps/checkpoint/inspect.py turns it into a CheckpointError."""

import subprocess
import sys
import time
import warnings

import pytest
from ckpt_forge import corrupt_global_heap, make_versions, path_of
from conftest import run_mpi

from hvps import cli
from hvps.checkpoint.format import CheckpointError
from hvps.checkpoint.inspect import read_header
from hvps.checkpoint.manager import CheckpointManager

DEADLINE = 2  # seconds, instead of the default 10


@pytest.fixture
def hanging(tmp_path, monkeypatch):
    """Versions 1 (good) and 2 (hangs libhdf5) in tmp_path; a short deadline."""
    monkeypatch.setenv("HVPS_CHECKPOINT_INSPECT_TIMEOUT", str(DEADLINE))
    make_versions(tmp_path)
    corrupt_global_heap(path_of(tmp_path, 2))
    return tmp_path


def test_the_file_really_hangs_libhdf5(hanging):
    code = "import sys; from hvps.checkpoint.format import read_header_local; read_header_local(sys.argv[1])"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code, str(path_of(hanging, 2))], timeout=DEADLINE + 1,
                       capture_output=True)


def test_read_header_names_the_file_and_the_reason(hanging):
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"ckpt-epoch-000002\.h5: inspecting its HDF5 metadata took over 2 s "
                                              r"\(HVPS_CHECKPOINT_INSPECT_TIMEOUT\): corrupt HDF5 structure\?"):
        read_header(path_of(hanging, 2))
    assert time.monotonic() - start < DEADLINE + 5
    assert read_header(path_of(hanging, 1)).epoch == 1  # a fresh helper after the killed one


def test_load_latest_falls_back(hanging):
    mgr = CheckpointManager(hanging)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mgr.load() == 2
    assert mgr.loaded.epoch == 1 and mgr.loaded.model["w"][0] == 1  # make_versions: arange(64) + epoch
    assert any("skipping checkpoint" in str(w.message) and "took over" in str(w.message) for w in caught)


def test_ckpt_verify_reports_it_bad(hanging, capsys):
    assert cli.main(["ckpt", "verify", str(hanging)]) == 1
    out = capsys.readouterr().out
    assert "OK " in out and "BAD" in out and "1 of 2 verified" in out
    reason = next(line for line in out.splitlines() if "took over" in line)
    assert "ckpt-epoch-000002.h5" in reason and "corrupt HDF5 structure?" in reason


def test_two_ranks_fall_back(tmp_path):
    result = run_mpi("mpi_ckpt_hang.py", 2, timeout=120,
                     env={"HVPS_TEST_SHARED_DIR": str(tmp_path), "HVPS_CHECKPOINT_INSPECT_TIMEOUT": str(DEADLINE)})
    result.assert_all_passed(min_passed=1)
