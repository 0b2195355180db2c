"""``init`` and ``shutdown``: build the topology, settings, backend and engine, and take them down.

Kept apart from ``state`` (what is running) so that the modules ``init`` wires together (engine,
process sets, metrics) can read the state without importing the code that builds it.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
from typing import Any, Optional

from .. import metrics
from ..core import devices
from ..core.errors import HvpsError
from ..core.settings import LOGGING_LEVELS, Settings, env_text, warn_unhonoured_horovod_variables
from ..dataplane import backends
from ..control.membership import MembershipChanged
from . import bootstrap, state
from .engine import Engine
from . import process_sets as _sets
from .state import Topology


def _node_comms(comm, node: Optional[str]):
    """Communicators over this node's ranks and over the ranks sharing this local rank.

    ``node`` names this process's node when the launcher said (a job started without MPI);
    otherwise MPI's shared-memory split finds the node. ``HVPS_LOCAL_SIZE=k`` overrides both:
    consecutive blocks of k ranks count as one node (to emulate several nodes on one machine).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    override = env_text("HVPS_LOCAL_SIZE")
    if override:
        if not override.isdigit() or int(override) < 1 or size % int(override):
            raise HvpsError(f"HVPS_LOCAL_SIZE={override!r} must be a positive divisor of the job size ({size})")
        local = comm.Split(color=rank // int(override), key=rank)
    elif node is not None:
        local = comm.Split(color=node, key=rank)
    else:
        from mpi4py import MPI

        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cross = comm.Split(color=local.Get_rank(), key=rank)
    return local, cross


def _topology(comm, local, cross) -> Topology:
    return Topology(comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size(),
                    cross.Get_rank(), cross.Get_size())


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hvps on ``comm`` (default: the job's, see :mod:`hvps.runtime.bootstrap`: MPI.COMM_WORLD
    under an MPI launcher, else hvpsrun's or torchrun's store). Reads ``HVPS_*`` settings from the
    environment and starts the engine thread. Calling it again only gives ``process_sets`` their ids.

    Args:
        comm: an mpi4py communicator to run on (it becomes ``global_process_set.mpi_comm``), or None.
        process_sets: ProcessSets (of ranks, or of mpi4py communicators) or lists of ranks, registered on
            every rank by the first ``init`` (see :mod:`hvps.runtime.process_sets`); or ``"dynamic"``,
            which allows ``add_process_set`` (``HOROVOD_DYNAMIC_PROCESS_SETS=1``).

    Raises:
        ValueError: on every rank, before anything is registered: a process set that is empty, has a
            rank outside the job, or differs across ranks; after the others are registered (hvps then
            runs): a duplicate set.
        HvpsError: the job could not be started.
    """
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"process_sets={process_sets!r}: pass a list of ProcessSets, or 'dynamic'")
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
        process_sets = None
    with state._state.lock:
        first = state._state.engine is None
        while first:
            try:
                to_register = _start(comm, process_sets)
                break
            except MembershipChanged as changed:  # an elastic job changed while this worker joined it
                logging.getLogger("hvps").info("hvps: %s; joining the new one", changed)
    if first:
        topology = state.topology()
        devices.reset(topology.local_rank)
        metrics.set_job_identity((topology.rank, topology.local_rank))
        _sets.setup(to_register)
        if comm is not None:
            _sets.global_process_set.mpi_comm = comm
        metrics.start_from_env()  # HVPS_METRICS_PORT: serve this rank's metrics on port + local rank
    _sets.attach(process_sets, comm)


def _start(comm, process_sets) -> list:
    """Build the topology, settings, backend and engine (under the state lock); return the process sets
    to register, agreed by every rank (:func:`hvps.runtime.process_sets.plan`) before anything starts."""
    boot = bootstrap.start(comm)
    comm = boot.comm
    request = _sets.request_of(process_sets, comm if boot.has_mpi else None)
    to_register = _sets.plan(comm.allgather(request), comm.Get_size())
    local, cross = _node_comms(comm, boot.node)
    topology = _topology(comm, local, cross)
    warn_unhonoured_horovod_variables()  # a migrated job's HOROVOD_* settings that hvps would ignore: said once
    settings = Settings.from_env().resolved(single_host=topology.local_size == topology.size, mpi=boot.has_mpi)
    try:
        backend = backends.build(settings, comm, local, cross, secret=boot.secret)
    finally:
        local.Free()
        cross.Free()
    if settings.log_level:
        logging.getLogger("hvps").setLevel(LOGGING_LEVELS[settings.log_level])
    state._state.topology = topology
    state._state.settings = settings
    state._state.engine = Engine(comm, backend, settings, control_key=boot.control_key())
    return to_register


def shutdown() -> None:
    """Stop the engine on every rank (collective). Safe to call when not initialized."""
    if state.forked():  # the engine is the parent's: leave it (and the job) alone
        return
    _sets.reset()
    devices.reset()
    metrics.set_job_identity(None)
    with state._state.lock:
        engine, state._state.engine = state._state.engine, None
        if engine is None:
            return
        state._state.topology = None
        why = engine.shutdown()
        if why is None or bootstrap.elastic_worker():
            # an elastic worker outlives a failed job: it re-initializes in place (hvd.elastic.run)
            engine.backend.close(failed=why is not None)
            return
    end_job(why)


def end_job(why: str) -> None:
    """End the whole job now, saying ``why``: MPI's abort (mpirun then ends every rank), or, without
    MPI, this process's exit (its closed control connections tell the others at once).

    For an engine that failed (a collective failed midway, a rank died or stopped answering): MPI's
    finalize, which mpi4py runs after the atexit handlers, waits for every rank, and would wait
    forever for one that is stopped or stuck. The user's error is printed before (atexit runs after
    Python has printed the traceback).
    """
    logging.getLogger("hvps").error("hvps: %s; aborting the job rather than waiting for every rank in "
                                    "MPI_Finalize", why)
    sys.stdout.flush()
    sys.stderr.flush()
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        _die_if_stuck(_ABORT_SECONDS)
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)


#: MPI's abort may itself wait (Open MPI 5 under --enable-recovery once left a survivor in it for good)
_ABORT_SECONDS = 10


def _die_if_stuck(seconds: int) -> None:
    """Let the kernel end this process (SIGALRM's default action) if it is still here after ``seconds``:
    no Python code needs to run for that, whatever thread holds the GIL."""
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
    except ValueError:  # not the main thread: keep the handler there is
        pass
    signal.alarm(seconds)


atexit.register(shutdown)
