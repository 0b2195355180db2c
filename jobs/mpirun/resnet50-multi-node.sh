#!/usr/bin/env bash
# ResNet-50 synthetic benchmark on several nodes from a hostfile, with plain mpirun.
#   HOSTFILE=hosts.txt jobs/mpirun/resnet50-multi-node.sh
# Hostfile lines: 'host slots=N'. The checkout and HVPS_PYTHON must exist at the same
# path on every host (shared file system), and mpirun must reach the hosts (ssh, or an rsh
# agent given in MPI_ARGS, e.g. the netns testbed's: MPI_ARGS="$(cat $TB_STATE/mpirun-args)").
# Environment (defaults): HOSTFILE=./hostfile; NP=total slots of HOSTFILE; MPIRUN=hvpsrun's choice (python -m hvps.runner.mpi_discovery);
# MPI_ARGS=''; NIC='' (e.g. eth0: Open MPI's TCP transport and runtime use only it; without it they use
# every interface, and the script warns); plus jobs/common.sh's.
# Result: $RESULTS_DIR/resnet50-mpirun-multi-np$NP.json
set -euo pipefail
source "$(dirname "$0")/../common.sh"
HOSTFILE=${HOSTFILE:-hostfile}
[ -f "$HOSTFILE" ] || { echo "resnet50-multi-node.sh: hostfile '$HOSTFILE' not found; set HOSTFILE" >&2; exit 2; }
NP=${NP:-$(awk '!/^#/ && NF { n = 1; for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { split($i, a, "="); n = a[2] } s += n } END { print s }' "$HOSTFILE")}
MPIRUN=${MPIRUN:-$("$HVPS_PYTHON" -m hvps.runner.mpi_discovery)}
MPI_ARGS=${MPI_ARGS:-}
NIC=${NIC:-}
NIC_ARGS=$("$HVPS_PYTHON" -m hvps.runner.mpi_transport --mpirun "$MPIRUN" --nic "$NIC" --mpi-args "$MPI_ARGS")
[ -n "$NIC" ] && NIC_ARGS="$NIC_ARGS -x NCCL_SOCKET_IFNAME=$NIC"
ROOT_FLAG=""; [ "$(id -u)" = 0 ] && ROOT_FLAG="--allow-run-as-root"
# shellcheck disable=SC2086
exec "$MPIRUN" -np "$NP" --hostfile "$HOSTFILE" $ROOT_FLAG --bind-to none --map-by slot \
    -x PYTHONPATH -x PATH -x OMP_NUM_THREADS=1 $NIC_ARGS $MPI_ARGS \
    "$HVPS_PYTHON" "$HARNESS" $BENCH_ARGS --json "$RESULTS_DIR/resnet50-mpirun-multi-np$NP.json"
