#!/usr/bin/env bash
# ResNet-50 synthetic benchmark on one node with hvpsrun (it adds the MPI flags itself).
#   NP=2 jobs/hvpsrun/resnet50-single-node.sh
# Environment (defaults): NP=2; HVPSRUN_ARGS='' extra hvpsrun flags (e.g. --verbose,
# --fusion-threshold-mb 32); plus HVPS_REPO, HVPS_PYTHON, RESULTS_DIR, BENCH_ARGS,
# HARNESS (see jobs/common.sh). Result: $RESULTS_DIR/resnet50-hvpsrun-np$NP.json
set -euo pipefail
source "$(dirname "$0")/../common.sh"
NP=${NP:-2}
HVPSRUN_ARGS=${HVPSRUN_ARGS:-}
# shellcheck disable=SC2086
exec $HVPSRUN -np "$NP" $HVPSRUN_ARGS \
    "$HVPS_PYTHON" "$HARNESS" $BENCH_ARGS --json "$RESULTS_DIR/resnet50-hvpsrun-np$NP.json"
