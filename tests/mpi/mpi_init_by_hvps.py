"""Inner multi-rank test: a script that leaves MPI to hvps (``mpi4py.rc.initialize = False``, as Horovod's
own tests do) gets MPI initialised by ``hvps.init()`` with thread support, and finalized by hvps at exit
(the job's exit status, which the outer test checks, says MPI was finalized on every rank).

Must be the first case of its job: mpi4py must not have initialised MPI in this process yet."""

import mpi4py

mpi4py.rc.initialize = False  # before mpi4py.MPI is imported, as a Horovod script does

import pytest  # noqa: E402

import hvps  # noqa: E402


def test_init_initialises_mpi_with_threads_and_leaves_it_for_the_script():
    from mpi4py import MPI

    assert not MPI.Is_initialized(), "this case must run first in a fresh process"
    hvps.init()
    try:
        assert MPI.Is_initialized() and not MPI.Is_finalized()
        assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
        assert hvps.mpi_threads_supported()
        assert MPI.COMM_WORLD.allgather(hvps.rank()) == list(range(hvps.size()))  # the script's own MPI calls work
        assert hvps.allreduce(1.0, op=hvps.Sum) == pytest.approx(hvps.size())
    finally:
        hvps.shutdown()
    assert MPI.Is_initialized() and not MPI.Is_finalized(), "MPI stays up until the process exits"
    hvps.init()  # and hvps starts again on it
    assert hvps.allreduce(2.0, op=hvps.Sum) == pytest.approx(2.0 * hvps.size())
    hvps.shutdown()
