"""The launcher table (hvps.core.launchers): one MPI version parser for mpirun's and the library's text,
and the table's variables as bootstrap and the doctor read them."""

from __future__ import annotations

import sys
import types

import pytest

from hvps.core.launchers import MPI_LAUNCH_VARIABLES, MpiImpl, parse_mpi_version
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
