"""Outer test: the torch gradient path (tests/mpi/mpi_grad_path.py) on 2 ranks, in one mpirun job:
``DistributedOptimizer`` is an instance of the wrapped optimizer's class (state_dict, LR schedulers),
and each gradient reaches ``Engine.submit_all`` in at most four Python frames with one handle and
one dtype check, averaged as numpy computes it."""

import pytest
from conftest import case


@pytest.mark.inner_cases(cases=lambda: [(2, case("grad-path", "mpi_grad_path.py", timeout=240))])
def test_grad_path(inner_results):
    inner_results["grad-path"].assert_all_passed()
