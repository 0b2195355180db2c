"""hvps: ring all-reduce collectives on MPI with Horovod's API.

``import hvps`` gives the framework-neutral core on numpy buffers; PyTorch users
``import hvps.adapters.torch as hvd``.
"""

from . import api, metrics
from .api import *  # noqa: F401,F403 - the names in api.__all__
from .metrics import energy
from .version import __version__

__all__ = ["__version__", "metrics", "energy", *api.__all__]
