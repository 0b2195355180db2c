"""The launcher table (hvps.core.launchers): one MPI version parser for mpirun's and the library's text,
and the table's variables as bootstrap and the doctor read them."""

from __future__ import annotations

import sys
import types

import pytest

from hvps.core.launchers import (
    MPI_LAUNCH_VARIABLES,
    RANK_VARIABLES,
    LauncherRank,
    MpiImpl,
    env_local_rank,
    env_rank,
    env_size,
    launcher_rank,
    parse_mpi_version,
)
from hvps.doctor import software
from hvps.runtime.bootstrap import launched_by

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text,impl,version", [
    # mpirun --version
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/", MpiImpl.OPEN_MPI, (4, 1, 4)),
    ("HYDRA build details:\n    Version:                                 4.1.2\n", MpiImpl.MPICH, (4, 1, 2)),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\nCopyright 2003-2023, "
     "Intel Corporation.", MpiImpl.INTEL_MPI, (2021, 10)),
    # MPI_Get_library_version (what the doctor reads under --all-ranks)
    ("Open MPI v5.0.11, package: Open MPI root@host Distribution, ident: 5.0.11, repo rev: v5.0.11",
     MpiImpl.OPEN_MPI, (5, 0, 11)),
    ("MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 12:29:21 CST 2024", MpiImpl.MPICH, (4, 2, 0)),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", MpiImpl.INTEL_MPI, (2021, 10)),
    ("MVAPICH-ish 9", MpiImpl.UNKNOWN, ()),
])
def test_one_parser_for_both_texts(text, impl, version):
    assert parse_mpi_version(text) == (impl, version)


@pytest.mark.parametrize("text,shown", [
    ("Open MPI v5.0.11, package: Open MPI root@host Distribution, ident: 5.0.11", "Open MPI 5.0.11"),
    ("MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9", "MPICH 4.2.0"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n\x00", "Intel MPI 2021.10"),
    ("Some Vendor MPI 3.1\nsecond line", "Some Vendor MPI 3.1"),
])
def test_doctor_names_the_loaded_library_by_the_table(monkeypatch, text, shown):
    fake = types.SimpleNamespace(Get_library_version=lambda: text)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    assert software.mpi_library() == shown


@pytest.mark.parametrize("name", ["OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK",
                                  "PMI_SIZE", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"])
def test_every_mpi_rank_variable_means_an_mpi_launch(name):
    assert name in MPI_LAUNCH_VARIABLES
    assert launched_by({name: "1"}) == "mpi"


def test_non_mpi_launchers_are_not_mpi():
    for env in ({"SLURM_PROCID": "0"}, {"HOROVOD_RANK": "0"}, {}):
        assert launched_by(env) == "alone"
    assert launched_by({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a"}) == "torchrun"


# ----------------------------------------------------------------------------- rank variables

OPEN_MPI_ENV = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "3"}
HYDRA_ENV = {"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"}
HOROVOD_ENV = {"HOROVOD_RANK": "2", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1"}
TORCHRUN_ENV = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "a"}
SLURM_ENV = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}


@pytest.mark.parametrize("env,expected", [
    (OPEN_MPI_ENV, LauncherRank("Open MPI", 3, 4, 1, 2)),
    (HYDRA_ENV, LauncherRank("Hydra", 5, 8, 1, 4)),  # MPICH and Intel MPI
    (HOROVOD_ENV, LauncherRank("Horovod", 2, 3, 0, 1)),  # hvpsrun --gloo, horovodrun
    (TORCHRUN_ENV, LauncherRank("torchrun", 6, 8, 2, 4)),
    (SLURM_ENV, LauncherRank("Slurm", 9, 16, 1, None)),
    ({"PMIX_RANK": "4"}, LauncherRank("PMIx", 4)),
    ({}, None),
])
def test_each_launchers_variables(env, expected):
    assert launcher_rank(env) == expected


@pytest.mark.parametrize("inner,outer", [
    (OPEN_MPI_ENV, SLURM_ENV),    # mpirun inside a Slurm batch step: the step's SLURM_PROCID=0 is inherited
    (HYDRA_ENV, SLURM_ENV),
    (TORCHRUN_ENV, SLURM_ENV),    # torchrun started once per node by srun
    (HOROVOD_ENV, SLURM_ENV),
    (SLURM_ENV, {"PMIX_RANK": "0"}),  # srun --mpi=pmix: Slurm's variables name the size too
])
def test_the_launcher_that_started_the_process_wins(inner, outer):
    """Rank and size always come from one launcher, never rank from one and size from another."""
    mixed = {**{k: "0" for k in outer}, **inner}
    assert launcher_rank(mixed) == launcher_rank(inner)


def test_defaults_and_garbage():
    assert (env_rank({}), env_size({}), env_local_rank({})) == (0, 1, 0)
    assert (env_rank({"PMIX_RANK": "4"}), env_size({"PMIX_RANK": "4"})) == (4, 1)  # PMIx names no size
    # a variable that is not a number is not believed; the next launcher's is
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "", "PMI_RANK": "x", "SLURM_PROCID": "2"}).launcher == "Slurm"
    # the retired names benchmarks and tests used to read are nobody's (hvpsrun sets HOROVOD_*)
    assert launcher_rank({"HVPS_RANK": "3", "PMIX_SIZE": "4"}) is None


def test_metrics_label_before_init_uses_the_one_rule(monkeypatch):
    from hvps import metrics

    monkeypatch.setattr(metrics, "_job_identity", None)
    for name in [n for names in RANK_VARIABLES for n in names.names]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")  # an mpirun inside a batch step
    for name, value in HYDRA_ENV.items():
        monkeypatch.setenv(name, value)
    assert metrics._identity() == (5, 1)
