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
from dataclasses import dataclass
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
    """One case of a job: its per-rank reports and output (``case_output``: the ranks' logs of this
    case; ``output`` adds the job's own output, mpirun's messages included)."""

    def __init__(self, cmd, returncode, output, reports, np, timed_out, elapsed, case_output=None):
        self.cmd = cmd
        self.returncode = returncode
        self.output = output
        self.case_output = output if case_output is None else case_output
        self.reports = reports  # rank -> dict (may miss ranks that crashed)
        self.np = np
        self.timed_out = timed_out
        self.elapsed = elapsed
        self.job_failed = False  # the job failed although this case's reports are clean
        self.case_dir = None  # see run_mpi_cases
        self.seconds = 0.0  # this case's wall time in the job (its slowest rank)

    def describe(self, tail=20000):
        lines = [f"command: {' '.join(map(str, self.cmd))}",
                 f"rc={self.returncode} timed_out={self.timed_out} "
                 f"elapsed={self.elapsed:.1f}s (the whole job)"]
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

    def problems(self, min_passed=1):
        """What keeps this case from being clean (see :meth:`assert_all_passed`)."""
        problems = []
        if self.timed_out and len(self.reports) < self.np:
            problems.append("the job timed out (killed) before this case finished")
        if self.job_failed:
            problems.append(f"the job's exit code was {self.returncode} with every case clean")
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
        low = self.case_output.lower()
        for word in (" skipped", " failed", " error", " xfailed", " xpassed"):
            for line in low.splitlines():
                if ("passed" in line or "no tests ran" in line) and word in line and " in " in line:
                    problems.append(f"summary line mentions{word}: {line.strip()}")
                    break
        return problems

    def clean(self):
        return not self.problems(min_passed=0)

    def assert_all_passed(self, min_passed=1):
        """Every rank reported; >=min_passed passed; no failed, errored, skipped, xfailed or xpassed
        test on any rank; every rank ran the same set of tests; the job neither timed out nor failed
        outside its cases."""
        problems = self.problems(min_passed)
        if problems:
            pytest.fail("inner MPI run not clean:\n  " + "\n  ".join(problems)
                        + "\n\n" + self.describe(), pytrace=False)


@dataclass(frozen=True)
class InnerCase:
    """One inner pytest session of a shared job: its name (unique in the job), what follows
    ``python -m pytest`` (inner modules, by name in tests/mpi or by path, and options such as ``-k``),
    the environment it runs under (``HVPS_*`` settings: hvps reads them in ``hvps.init``) and the
    seconds it may take."""

    name: str
    args: tuple
    env: tuple = ()  # sorted (name, value) pairs: see :func:`case`
    timeout: float = 300
    job: str = ""  # cases with different labels never share a job (e.g. one that needs a fresh process)


def case(name, *args, env=None, timeout=300, job=""):
    """An :class:`InnerCase`; ``args`` are inner modules and pytest options, ``env`` a mapping."""
    return InnerCase(name, tuple(str(a) for a in args), tuple(sorted((k, str(v)) for k, v in (env or {}).items())),
                     timeout, job)


def _inner_arg(arg):
    p = Path(arg)
    if arg.endswith(".py") and not p.is_absolute() and not p.exists():
        return str(MPI_DIR / p)
    return arg


def _slice_reports(report_dir, np):
    reports, logs, seconds = {}, [], 0.0
    for rank in range(np):
        try:
            seconds = max(seconds, float((Path(report_dir) / f"rank{rank}.seconds").read_text()))
        except (OSError, ValueError):
            pass
        f = Path(report_dir) / f"rank{rank}.json"
        try:
            rep = json.loads(f.read_text())
            reports[int(rep["rank"])] = rep
        except (OSError, ValueError):
            pass
        log = Path(report_dir) / f"rank{rank}.log"
        if log.exists():
            logs.append(f"--- rank {rank} ---\n" + log.read_text(errors="replace"))
    return reports, "\n".join(logs), seconds


def _case_done(report_dir, np):
    return all((Path(report_dir) / f"rank{rank}.seconds").exists() for rank in range(np))


def run_mpi_cases(cases, np, env=None, use_mpirun=True, work_dir=None, launcher="mpirun"):
    """Run ``cases`` (:class:`InnerCase`) one after another in ONE job of ``np`` ranks
    (``tests/mpi/run_cases.py``): MPI start-up and the framework imports are paid once.

    ``env`` is the job's environment (what mpirun and the interpreter read at start); each case adds
    its own. A case without ``HVPS_TEST_SHARED_DIR`` gets a fresh shared directory. Returns
    ``{case name: MpiResult}``. A case that runs past its timeout gets the job killed (it and the cases
    after it then fail; those before it keep their results).
    With ``use_mpirun=False`` the job is one plain process (world size 1, MPI singleton init). With
    ``launcher="gloo"`` it is started by ``hvpsrun --gloo``, without MPI (mpi4py is never imported).

    Each case has a directory (``MpiResult.case_dir``; ``{case_dir}`` in a case's environment
    stands for it) under ``work_dir``, which is kept; without ``work_dir`` a temporary one is
    used and removed.
    """
    import tempfile

    names = [c.name for c in cases]
    assert len(set(names)) == len(names), f"case names repeat: {names}"
    own_work = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="hvps-job-") if own_work else work_dir)
    plan = []
    for c in cases:
        case_dir = work / c.name
        (case_dir / "shared").mkdir(parents=True)
        case_env = {k: v.replace("{case_dir}", str(case_dir)) for k, v in c.env}
        if "HVPS_TEST_SHARED_DIR" not in case_env and not (env or {}).get("HVPS_TEST_SHARED_DIR"):
            case_env["HVPS_TEST_SHARED_DIR"] = str(case_dir / "shared")
        plan.append({"name": c.name, "args": [_inner_arg(a) for a in c.args], "env": case_env,
                     "report_dir": str(case_dir)})
    (work / "plan.json").write_text(json.dumps({"cases": plan}))

    env = _base_env(env)
    inner = [sys.executable, str(MPI_DIR / "run_cases.py"), str(work / "plan.json")]
    if use_mpirun and launcher == "gloo":
        cmd = [sys.executable, "-m", "hvps.runner.launch", "--gloo", "-np", str(np), *inner]
    elif use_mpirun:
        cmd, env = mpirun_argv(np, inner, env)
    else:
        np = 1
        cmd = inner
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    timed_out = False
    # Each case keeps its own time limit: its clock starts when the case before it has ended on
    # every rank (the first case's at the job's start, so MPI start-up counts against it).
    current, case_start = 0, start
    while True:
        try:
            out, _ = proc.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            pass
        while current < len(cases) and _case_done(plan[current]["report_dir"], np):
            current, case_start = current + 1, time.monotonic()
        if current < len(cases) and time.monotonic() - case_start > cases[current].timeout:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, _ = proc.communicate()
            break
    elapsed = time.monotonic() - start
    job_output = out.decode("utf-8", "replace")

    results = {}
    for c, entry in zip(cases, plan):
        reports, logs, seconds = _slice_reports(entry["report_dir"], np)
        results[c.name] = MpiResult(cmd, proc.returncode, logs + "\n=== job output ===\n" + job_output,
                                    reports, np, timed_out, elapsed, case_output=logs)
        results[c.name].case_dir = None if own_work else Path(entry["report_dir"])
        results[c.name].seconds = seconds
    # A job that failed with every case clean (a crash after the last case, an mpirun error) fails them all.
    if proc.returncode != 0 and not timed_out and all(r.clean() for r in results.values()):
        for r in results.values():
            r.job_failed = True
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return results


def run_mpi(script_or_args, np, env=None, timeout=300, extra_pytest_args=(), use_mpirun=True):
    """Run an inner pytest module under ``mpirun -np <np>`` (a job of one case).

    ``script_or_args`` is an inner module (path or name relative to tests/mpi) or a list of
    arguments appended after ``python -m pytest``. Returns an :class:`MpiResult`; never hangs
    longer than ``timeout`` seconds (the whole process group is killed on timeout).

    With ``use_mpirun=False`` the module runs in one plain process (world size 1, MPI singleton
    init). ``env`` goes to the whole job (mpirun and the ranks' start-up read it too).
    """
    if isinstance(script_or_args, (str, os.PathLike)):
        args = [str(script_or_args)]
    else:
        args = [str(a) for a in script_or_args]
    only = case("job", *extra_pytest_args, *args, timeout=timeout)
    return run_mpi_cases([only], np, env=env, use_mpirun=use_mpirun)["job"]


# ---------------------------------------------------------------- jobs shared by a module's tests

# The share name of the smaller multi-rank modules (checkpoints, compression, the store, process
# sets and Horovod semantics, threads, control-plane attacks): one job per rank count for all of them.
SHARED_JOBS = "multirank-modules"

@dataclass(frozen=True)
class JobKey:
    """What makes two cases able to share a job: the outer module (or the name several modules share),
    the rank count, mpirun or not (and which launcher), and the job's own environment."""

    module: str
    np: int
    use_mpirun: bool
    env: tuple
    launcher: str = "mpirun"  # or "gloo": hvpsrun --gloo (see run_mpi_cases)


def _item_cases(item):
    """``[(JobKey, InnerCase)]`` that a test marked ``inner_cases(cases=fn, use_mpirun=True, env=None,
    share=None, launcher="mpirun")`` needs: ``fn(**its parameters)`` returns ``[(np, InnerCase)]``. Tests of
    several modules that give the same ``share`` name share their jobs too."""
    marker = item.get_closest_marker("inner_cases")
    if marker is None:
        return []
    params = item.callspec.params if hasattr(item, "callspec") else {}
    use_mpirun = marker.kwargs.get("use_mpirun", True)
    env = tuple(sorted((marker.kwargs.get("env") or {}).items()))
    wanted = marker.kwargs["cases"](**params)
    module = marker.kwargs.get("share") or item.nodeid.split("::")[0]
    launcher = marker.kwargs.get("launcher", "mpirun")
    return [(JobKey(f"{module}#{c.job}" if c.job else module, np if use_mpirun else 1, use_mpirun, env, launcher), c)
            for np, c in wanted]


class InnerJobs:
    """Runs each job once per session: every case that the selected tests of one outer module (or of
    the modules sharing a name) need at one rank count (and job environment), in one job, when the
    first of those tests asks."""

    def __init__(self, items, tmp_path_factory=None):
        self.items = items
        self.results = {}
        self.tmp_path_factory = tmp_path_factory

    def cases_of(self, key):
        cases = {}
        for item in self.items:
            for k, c in _item_cases(item):
                if k == key:
                    assert cases.setdefault(c.name, c) == c, f"two different cases named {c.name} in {key}"
        return list(cases.values())

    def for_item(self, item):
        out = {}
        for key, c in _item_cases(item):
            if (key, c.name) not in self.results:
                work = self.tmp_path_factory.mktemp(f"job-np{key.np}") if self.tmp_path_factory else None
                found = run_mpi_cases(self.cases_of(key), key.np, env=dict(key.env), use_mpirun=key.use_mpirun,
                                      work_dir=work, launcher=key.launcher)
                self.results.update({(key, name): r for name, r in found.items()})
            out[c.name] = self.results[(key, c.name)]
        return out


# Under pytest-xdist (`make test` runs `-n 2 --dist loadfile`), the tests that one worker must run together
# (one xdist scope each): a shared inner job's tests (each worker that ran one of them would run the whole job
# again), each file's tests (its module fixtures run once), and the files that stand up a Slurm cluster or
# network namespaces (one testbed at a time on the machine). Workers know the groups (they collect the items
# and read their marks); the controller, which schedules, sees only node ids: each worker writes
# {node id: group} to a file the controller named, and the controller's scheduler reads it.
TESTBED_FILES = ("test_slurm.py", "test_slurm_gpu.py", "test_multihost.py", "test_multihost_gloo.py")
GROUPS_FILE = "hvps_groups_file"  # key of the workers' xdist workerinput
# The groups that take a minute or more on a quiet 2-core machine, longest first: they start first, so that
# no long one is left for the end while the other worker idles (the rest keep their collection order).
LONGEST_FIRST = ("tests/test_multirank.py", SHARED_JOBS, "tests/test_conformance.py", "tests/test_elastic_launch.py",
                 "testbeds", "tests/test_tensorflow_adapter.py", "tests/test_examples.py", "tests/test_gloo_run.py",
                 "tests/test_docs_snippets.py", "tests/test_fuzz.py")


def xdist_group(item) -> str:
    """The scope ``item`` runs in under xdist: a shared job's name, "testbeds", or its file."""
    keys = _item_cases(item)
    if keys:
        return keys[0][0].module.split("#")[0]
    path = item.nodeid.split("::")[0]
    return "testbeds" if Path(path).name in TESTBED_FILES else path


def _order_for_xdist(config, items) -> None:
    """On an xdist worker: put the longest groups first (every worker sorts alike: same collection) and write
    each item's group where the controller's scheduler reads it."""
    path = getattr(config, "workerinput", {}).get(GROUPS_FILE)
    if not path:
        return
    groups = {item.nodeid: xdist_group(item) for item in items}
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(rank)))  # stable: the rest keep their order
    mine = f"{path}.{config.workerinput['workerid']}"
    Path(mine + ".tmp").write_text(json.dumps(groups))
    os.replace(mine + ".tmp", mine)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller: tell each worker where to write its groups."""
    node.workerinput[GROUPS_FILE] = str(node.config._tmp_path_factory.getbasetemp() / "xdist-groups.json")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist controller, ``--dist loadfile``: schedule by the workers' groups, in the workers' order (see above)."""
    if config.getvalue("dist") != "loadfile":
        return None
    config.option.loadscopereorder = False  # xdist would put the groups with the most tests first
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                base = config._tmp_path_factory.getbasetemp() / "xdist-groups.json"
                found = sorted(base.parent.glob(base.name + ".gw*"))
                self.groups = json.loads(found[0].read_text()) if found else {}
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A test that shares a job may be the one that runs it: its timeout covers the whole job. Under xdist,
    each worker also writes the items' groups (above)."""
    _order_for_xdist(config, items)
    jobs = InnerJobs(items)
    totals = {}
    for item in items:
        for key, _ in _item_cases(item):
            if key not in totals:
                totals[key] = sum(c.timeout for c in jobs.cases_of(key))
    for item in items:
        keys = {key for key, _ in _item_cases(item)}
        if keys:
            item.add_marker(pytest.mark.timeout(sum(totals[k] for k in keys) + 120), append=False)


_JOBS = []  # the InnerJobs of this session, for the summary below


@pytest.fixture(scope="session")
def inner_jobs(request, tmp_path_factory):
    jobs = InnerJobs(request.session.items, tmp_path_factory)
    _JOBS.append(jobs)
    return jobs


def pytest_terminal_summary(terminalreporter, config):
    """Shared jobs show up in --durations as one test's setup: with --durations, list their cases too."""
    count = config.getoption("durations", None)
    found = [(r.seconds, key, name) for jobs in _JOBS for (key, name), r in jobs.results.items()]
    if count is None or not found:
        return
    found.sort(key=lambda t: -t[0])
    terminalreporter.write_sep("=", "slowest inner cases (in shared jobs)")
    for seconds, key, name in found[:count or None]:
        terminalreporter.write_line(f"{seconds:8.2f}s {key.module} np{key.np} {name}")


@pytest.fixture
def inner_results(request, inner_jobs):
    """``{case name: MpiResult}`` for this test's ``inner_cases`` (its jobs run when first needed)."""
    return inner_jobs.for_item(request.node)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A test marked ``unit`` that starts a process fails: ``pytest -m unit`` must stay quick and
    self-contained (no MPI job, no helper, no daemon)."""
    if request.node.get_closest_marker("unit") is not None:
        def refuse(self, args, *rest, **kwargs):
            raise AssertionError(f"a test marked unit started a process: {args!r}; remove its unit mark")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


@pytest.fixture
def mpi_runner():
    """Fixture form of :func:`run_mpi`."""
    return run_mpi
