"""Inner (per-rank) pytest configuration for tests/mpi/mpi_*.py.

Each rank runs its own pytest session under mpirun.  This conftest records
every test outcome and writes ``$HVPS_TEST_REPORT_DIR/rank<R>.json`` so that
the outer test can verify per rank that tests passed with no failures, errors
or skips. The report is written at session end, and at once after every failure:
a failed rank's hvps.shutdown at teardown may abort the job (a peer is gone or
stuck), and the failure's text must reach the outer test all the same.
"""

import json
import os
from pathlib import Path

import pytest


_counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0,
           "xfailed": 0, "xpassed": 0}
_passed_ids = []
_failures = {}


def pytest_runtest_logreport(report):
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            _counts["xfailed" if report.skipped else "xpassed"] += 1
        elif report.passed:
            _counts["passed"] += 1
            _passed_ids.append(report.nodeid)
        elif report.failed:
            _counts["failed"] += 1
            _record_failure(report.nodeid, report.longrepr)
        elif report.skipped:
            _counts["skipped"] += 1
    else:
        if report.failed:
            _counts["error"] += 1
            _record_failure(f"{report.nodeid} [{report.when}]", report.longrepr)
        elif report.skipped:
            _counts["skipped"] += 1


def pytest_collectreport(report):
    if report.failed:
        _counts["error"] += 1
        _record_failure(f"collect {report.nodeid}", report.longrepr)


def _record_failure(nodeid, longrepr):
    _failures[nodeid] = str(longrepr)
    _write_report(exitstatus=1)  # final only if the session ends normally (pytest_sessionfinish rewrites it)


def _write_report(exitstatus):
    out_dir = os.environ.get("HVPS_TEST_REPORT_DIR")
    if not out_dir:
        return
    from hvps.core.launchers import env_rank  # lazily, as hvps itself below

    rank = env_rank()
    data = {"rank": rank, "exitstatus": int(exitstatus), "counts": _counts,
            "passed_ids": _passed_ids, "failures": _failures}
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def pytest_sessionfinish(session, exitstatus):
    _write_report(exitstatus)


@pytest.fixture(scope="session", autouse=True)
def _hvps_shutdown_at_end():
    """Shut hvps down once every test of this rank has run."""
    yield
    try:
        import hvps
    except Exception:  # import problems are reported by the tests themselves
        return
    if hvps.is_initialized():
        hvps.shutdown()
        assert not hvps.is_initialized()


@pytest.fixture(scope="session")
def shared_dir():
    """A directory shared by all ranks of this mpirun (set by the outer test)."""
    d = os.environ.get("HVPS_TEST_SHARED_DIR")
    assert d, "HVPS_TEST_SHARED_DIR must be set by the outer test"
    return Path(d)
