"""One rank of a shared multi-rank job: several inner pytest sessions ("cases"), one after another.

Each job pays MPI start-up and a torch/TensorFlow import once, then runs every case it was given
(``tests/conftest.run_mpi_cases`` writes the plan as JSON; its path is argv[1]). A case is a list of
pytest arguments (inner modules, ``-k``) and the environment its session sees: hvps reads its
``HVPS_*`` settings in ``hvps.init``, and the inner modules are imported afresh for every case, so a
module that reads a variable at import time sees its case's value. Between cases hvps is shut down
(the inner conftest does it at the end of each session), so each case starts uninitialized, as a
fresh process would.

Each case's output (this rank's pytest session, and a faulthandler trace should the process die) goes
to ``<report_dir>/rank<R>.log``, its per-test outcomes to ``<report_dir>/rank<R>.json`` (written by
the inner conftest), its wall time to ``<report_dir>/rank<R>.seconds``. Exit status: 0 when every case's session passed on this rank.
"""

import json
import os
import sys
import time
from pathlib import Path

import pytest

MPI_DIR = Path(__file__).resolve().parent
PYTEST_ARGS = ["-q", "-p", "no:cacheprovider", "-rfEsxX", "--color=no"]


def forget_inner_modules() -> None:
    """Drop the modules imported from tests/mpi, so the next case imports them under its environment."""
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and Path(path).resolve().parent == MPI_DIR and name != "__main__":
            del sys.modules[name]


def shutdown_hvps() -> None:
    hvps = sys.modules.get("hvps")
    if hvps is not None and hvps.is_initialized():
        hvps.shutdown()


def run_case(case: dict, rank: int) -> int:
    """One pytest session under the case's environment (restored afterwards); its exit status."""
    report_dir = Path(case["report_dir"])
    saved = dict(os.environ)  # restored whole afterwards: a module may set variables at import
    os.environ.update(case["env"], HVPS_TEST_REPORT_DIR=str(report_dir))
    forget_inner_modules()
    sys.stdout.flush()
    sys.stderr.flush()
    real_out, real_err = os.dup(1), os.dup(2)
    start = time.monotonic()
    with open(report_dir / f"rank{rank}.log", "wb", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            status = int(pytest.main(PYTEST_ARGS + list(case["args"])))
            shutdown_hvps()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(real_out, 1)
            os.dup2(real_err, 2)
            os.close(real_out)
            os.close(real_err)
            (report_dir / f"rank{rank}.seconds").write_text(f"{time.monotonic() - start:.3f}")
            os.environ.clear()
            os.environ.update(saved)
    return status


def main(plan_path: str) -> int:
    from hvps.core.launchers import env_rank  # no hvps import before main: its failure is a case's to report

    plan = json.loads(Path(plan_path).read_text())
    rank = env_rank()
    failed = []
    for case in plan["cases"]:
        print(f"=== rank {rank}: case {case['name']}", flush=True)
        status = run_case(case, rank)
        if status != 0:
            failed.append(case["name"])
            print(f"=== rank {rank}: case {case['name']} ended with pytest status {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
