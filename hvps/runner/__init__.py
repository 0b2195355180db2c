"""hvpsrun: builds mpirun / srun command lines and supervises restarts.

Modules: ``settings`` (flags), ``hosts`` (host lists, hostfiles), ``mpi_command``
(mpirun line), ``slurm_command`` (srun line), ``check_build``, ``supervisor``
(restarts) and ``launch`` (``main``, the ``hvpsrun`` console script).
"""
