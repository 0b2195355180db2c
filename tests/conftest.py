"""Shared fixtures for the hvps test suite (outer, single-process side).

The multi-rank tests live in ``tests/mpi/mpi_*.py``.  Those files are *not*
collected by the outer pytest run (their names do not match ``test_*.py``);
instead ``tests/test_multirank.py`` launches them under ``mpirun`` through
:func:`run_mpi`, and each rank runs its own inner pytest session.  Every rank
writes a JSON report (see ``tests/mpi/conftest.py``) so the outer test can
check, rank by rank, that tests passed and that nothing failed, errored or
was skipped.
"""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvps.core.mpi_env import mpi_defaults
from hvps.runner.errors import LaunchError
from hvps.runner.mpi_command import build_mpirun_command, launch_environment
from hvps.runner.mpi_discovery import find_mpirun
from hvps.runner.settings import LaunchSettings

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
MPI_DIR = TESTS_DIR / "mpi"

# The outer run must never descend into tests/mpi (the inner conftest and the
# inner modules are only meaningful under mpirun).  The inner runs set
# HVPS_TEST_INNER=1 so that explicitly passed inner files are collected.
if not os.environ.get("HVPS_TEST_INNER"):
    collect_ignore = ["mpi"]

# Long enough that a rank descheduled on a loaded 2-core machine is not a stall;
# the error tests set a short stall time of their own.
DEFAULT_STALL_SECONDS = "30"


@functools.lru_cache(maxsize=None)
def mpi_launcher():
    """The MPI the multi-rank tests run on: $HVPS_TEST_MPIRUN, else hvpsrun's rule ($HVPS_MPIRUN,
    beside this Python, PATH)."""
    try:
        return find_mpirun(os.environ.get("HVPS_TEST_MPIRUN") or None)
    except LaunchError as exc:
        pytest.fail(f"no mpirun for the multi-rank tests: {exc}")


def mpirun_path():
    return mpi_launcher().path


def _base_env(extra):
    env = dict(os.environ)
    # Make the in-tree package importable even before `pip install -e .`.
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pp if pp else "")
    env["HVPS_TEST_INNER"] = "1"
    env.setdefault("HVPS_STALL_CHECK_TIME_SECONDS", DEFAULT_STALL_SECONDS)
    env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    # Oversubscribed runs on a 2-core box: do not busy-poll.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return dict(mpi_defaults(env))


def mpirun_argv(np, argv, env):
    """``(cmd, env)`` to run ``argv`` on ``np`` ranks: hvpsrun's own command line for the MPI found
    (Open MPI 4/5 or MPICH flags; HVPS_*, PYTHON* and PATH forwarded by name)."""
    settings = LaunchSettings(command=tuple(argv), num_proc=np)
    cmd = build_mpirun_command(settings, env, mpi=mpi_launcher(), hosts=[])
    return cmd, launch_environment(settings, env, np, [], os.cpu_count() or 1)


class MpiResult:
    def __init__(self, cmd, returncode, output, reports, np, timed_out, elapsed):
        self.cmd = cmd
        self.returncode = returncode
        self.output = output
        self.reports = reports  # rank -> dict (may miss ranks that crashed)
        self.np = np
        self.timed_out = timed_out
        self.elapsed = elapsed

    def describe(self, tail=20000):
        lines = [f"command: {' '.join(map(str, self.cmd))}",
                 f"rc={self.returncode} timed_out={self.timed_out} "
                 f"elapsed={self.elapsed:.1f}s"]
        for rank in range(self.np):
            rep = self.reports.get(rank)
            if rep is None:
                lines.append(f"rank {rank}: NO REPORT (crashed or hung)")
                continue
            lines.append(f"rank {rank}: counts={rep['counts']}")
            for nodeid, text in rep.get("failures", {}).items():
                lines.append(f"--- rank {rank} {nodeid} ---\n{text[-4000:]}")
        out = self.output
        if len(out) > tail:
            out = "...[truncated]...\n" + out[-tail:]
        lines.append("=== combined output ===\n" + out)
        return "\n".join(lines)

    def assert_all_passed(self, min_passed=1):
        """rc == 0; every rank reported; >=min_passed passed; no failed,
        errored, skipped, xfailed or xpassed test on any rank; and every
        rank ran the same set of tests."""
        problems = []
        if self.timed_out:
            problems.append("mpirun timed out (killed)")
        if self.returncode != 0:
            problems.append(f"mpirun exit code {self.returncode}")
        nodeids = None
        for rank in range(self.np):
            rep = self.reports.get(rank)
            if rep is None:
                problems.append(f"rank {rank} wrote no report")
                continue
            c = rep["counts"]
            if c.get("passed", 0) < min_passed:
                problems.append(f"rank {rank}: only {c.get('passed', 0)} passed")
            for bad in ("failed", "error", "skipped", "xfailed", "xpassed"):
                if c.get(bad, 0):
                    problems.append(f"rank {rank}: {c[bad]} {bad}")
            if rep.get("exitstatus") != 0:
                problems.append(f"rank {rank}: pytest exitstatus {rep.get('exitstatus')}")
            ids = sorted(rep.get("passed_ids", []))
            if nodeids is None:
                nodeids = ids
            elif ids != nodeids:
                problems.append(f"rank {rank} passed a different set of tests than rank 0")
        # Belt and braces: the textual summary must not mention skips/failures.
        low = self.output.lower()
        for word in (" skipped", " failed", " error", " xfailed", " xpassed"):
            for line in low.splitlines():
                if ("passed" in line or "no tests ran" in line) and word in line and " in " in line:
                    problems.append(f"summary line mentions{word}: {line.strip()}")
                    break
        if problems:
            pytest.fail("inner MPI run not clean:\n  " + "\n  ".join(problems)
                        + "\n\n" + self.describe(), pytrace=False)


def run_mpi(script_or_args, np, env=None, timeout=300, report_dir=None,
            extra_pytest_args=(), use_mpirun=True):
    """Run an inner pytest module under ``mpirun -np <np>``.

    ``script_or_args`` is an inner module (path or name relative to
    tests/mpi) or a list of arguments appended after ``python -m pytest``.
    Returns an :class:`MpiResult`; never hangs longer than ``timeout``
    seconds (the whole process group is killed on timeout).

    With ``use_mpirun=False`` the module runs in one plain process (world
    size 1, MPI singleton init).
    """
    if isinstance(script_or_args, (str, os.PathLike)):
        p = Path(script_or_args)
        if not p.is_absolute() and not p.exists():
            p = MPI_DIR / p
        args = [str(p)]
    else:
        args = [str(a) for a in script_or_args]

    own_report_dir = report_dir is None
    if own_report_dir:
        import tempfile
        report_dir = tempfile.mkdtemp(prefix="hvps-reports-")
    report_dir = str(report_dir)
    env = _base_env(env)
    env["HVPS_TEST_REPORT_DIR"] = report_dir

    inner = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "-rfEsxX", "--color=no", *extra_pytest_args, *args]
    if use_mpirun:
        cmd, env = mpirun_argv(np, inner, env)
    else:
        np = 1
        cmd = inner

    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
    elapsed = time.monotonic() - start
    text = out.decode("utf-8", "replace")

    reports = {}
    for f in Path(report_dir).glob("rank*.json"):
        try:
            rep = json.loads(f.read_text())
        except ValueError:
            continue
        reports[int(rep["rank"])] = rep
    if own_report_dir:
        shutil.rmtree(report_dir, ignore_errors=True)
    return MpiResult(cmd, proc.returncode, text, reports, np, timed_out, elapsed)


@pytest.fixture
def mpi_runner():
    """Fixture form of :func:`run_mpi`."""
    return run_mpi
