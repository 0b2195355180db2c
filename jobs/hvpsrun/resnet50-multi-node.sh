#!/usr/bin/env bash
# ResNet-50 synthetic benchmark on several nodes from a hostfile with hvpsrun.
#   HOSTFILE=hosts.txt jobs/hvpsrun/resnet50-multi-node.sh
# Hostfile lines: 'host slots=N' (same checkout path on every host).
# Environment (defaults): HOSTFILE=./hostfile; NP='' (hvpsrun uses all slots);
# MPI_ARGS='' extra mpirun flags (e.g. the netns testbed's rsh agent); NIC='' (e.g. eth0);
# HVPSRUN_ARGS=''; plus jobs/common.sh's. Result: $RESULTS_DIR/resnet50-hvpsrun-multi.json
set -euo pipefail
source "$(dirname "$0")/../common.sh"
HOSTFILE=${HOSTFILE:-hostfile}
NP=${NP:-}
MPI_ARGS=${MPI_ARGS:-}
NIC=${NIC:-}
HVPSRUN_ARGS=${HVPSRUN_ARGS:-}
args=(--hostfile "$HOSTFILE")
[ -n "$NP" ] && args+=(-np "$NP")
[ -n "$MPI_ARGS" ] && args+=(--mpi-args "$MPI_ARGS")
[ -n "$NIC" ] && args+=(--network-interface "$NIC")
# shellcheck disable=SC2086
exec $HVPSRUN "${args[@]}" $HVPSRUN_ARGS \
    "$HVPS_PYTHON" "$HARNESS" $BENCH_ARGS --json "$RESULTS_DIR/resnet50-hvpsrun-multi.json"
