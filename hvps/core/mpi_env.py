"""Environment that MPI needs and that a bare environment may lack.

One place for what every MPI process of a job should see, whoever starts it:
``hvps.init`` applies it to its own process (a singleton run), ``hvpsrun`` to the
launcher it runs, and the tests to the jobs they start.
"""

from __future__ import annotations

import os
import pwd
import tempfile
from typing import MutableMapping


def _home() -> str:
    try:
        home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid with no passwd entry (containers)
        home = ""
    return home if home and os.path.isdir(home) else tempfile.gettempdir()


def mpi_defaults(env: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Fill in (never override) what Open MPI needs; returns ``env``, changed in place.

    - ``HOME``: Open MPI 5 fails in ``opal_init`` ("Unable to get the user home
      directory") when it is unset, in mpirun and in singleton mode alike; any
      directory will do, so use the user's own or else the temporary directory.
    - ``OMPI_MCA_mpi_yield_when_idle=1``: the engine thread shares cores with
      training, so blocking MPI calls should yield the core rather than spin.
    - ``OMPI_MCA_op=^avx``: Open MPI 4.1's AVX reduction kernels saturate integer
      sums that overflow (open-mpi/ompi#8045); results must wrap as numpy's do.
    """
    if not env.get("HOME"):
        env["HOME"] = _home()
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env.setdefault("OMPI_MCA_op", "^avx")
    return env
