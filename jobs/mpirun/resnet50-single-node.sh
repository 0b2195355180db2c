#!/usr/bin/env bash
# ResNet-50 synthetic benchmark on one node with plain mpirun.
#   NP=2 jobs/mpirun/resnet50-single-node.sh
# Environment (defaults): NP=2 ranks; MPIRUN=hvpsrun's choice (python -m hvps.runner.mpi_discovery); MPI_ARGS='' extra mpirun flags;
# Open MPI's TCP transport stays off (shared memory and self only: no rank listens on a TCP port),
# as hvpsrun does it (python -m hvps.runner.mpi_transport --one-host), unless MPI_ARGS sets btl.
# plus HVPS_REPO, HVPS_PYTHON, RESULTS_DIR, BENCH_ARGS, HARNESS (see jobs/common.sh).
# Result: $RESULTS_DIR/resnet50-mpirun-np$NP.json
set -euo pipefail
source "$(dirname "$0")/../common.sh"
NP=${NP:-2}
MPIRUN=${MPIRUN:-$("$HVPS_PYTHON" -m hvps.runner.mpi_discovery)}
MPI_ARGS=${MPI_ARGS:-}
TRANSPORT_ARGS=$("$HVPS_PYTHON" -m hvps.runner.mpi_transport --mpirun "$MPIRUN" --one-host --mpi-args "$MPI_ARGS")
# shellcheck disable=SC2046,SC2086
exec "$MPIRUN" -np "$NP" $(ompi_local_flags "$NP") --bind-to none --map-by slot \
    -x PYTHONPATH -x PATH -x OMP_NUM_THREADS=1 $TRANSPORT_ARGS $MPI_ARGS \
    "$HVPS_PYTHON" "$HARNESS" $BENCH_ARGS --json "$RESULTS_DIR/resnet50-mpirun-np$NP.json"
