#!/usr/bin/env bash
# Run hvps's three target checks and write their JSON to OUT_DIR:
#   allreduce_64MiB.json  64 MiB float32 allreduce, hvps (mpi, ring) vs raw mpi4py
#   tdist_64MiB.json      the same through hvps on torch.distributed (gloo) vs direct all_reduce (target >= 0.9x)
#   fusion.json           ResNet-50's 161 grads through DistributedOptimizer vs one raw Allreduce (target <= 1.25)
#   resnet50.json         ResNet-50, NP ranks x 1 thread: distributed vs no-comm (target >= 0.97) and vs 1 rank
# then print a one-line verdict per check.
#
# Usage: benchmarks/run_targets.sh OUT_DIR
# Knobs (environment): PYTHON (default: python3), NP (2), ROUNDS (5), MPIRUN_ARGS ("--bind-to none --map-by slot"),
#   BATCH (8), IMAGE (128), ITERS (3), BATCHES_PER_ITER (2), WARMUP (2), RESNET_ROUNDS (3).
# The defaults fit a 2-core box in a few minutes; on a real node raise BATCH/IMAGE (e.g. 32/224).
set -euo pipefail

OUT=${1:?usage: $0 OUT_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PYTHON=${PYTHON:-python3}
NP=${NP:-2}
ROUNDS=${ROUNDS:-5}
MPIRUN_ARGS=${MPIRUN_ARGS:---bind-to none --map-by slot}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
ROOT_FLAG=()
[ "$(id -u)" = 0 ] && ROOT_FLAG=(--allow-run-as-root)

echo "== 1/3 allreduce 64 MiB (raw vs hvps-mpi vs hvps-ring, $ROUNDS rounds)"
"$PYTHON" "$HERE/allreduce.py" --np "$NP" --sizes 64MiB --rounds "$ROUNDS" --iters-large 20 \
    --mpirun-args "$MPIRUN_ARGS" --json "$OUT/allreduce_64MiB.json"

echo "== 1b/3 allreduce 64 MiB on gloo (direct torch.distributed vs hvps HVPS_BACKEND=tdist, $ROUNDS rounds)"
"$PYTHON" "$HERE/allreduce.py" --np "$NP" --sizes 64MiB --impls tdist,hvps-tdist --rounds "$ROUNDS" \
    --iters-large 20 --mpirun-args "$MPIRUN_ARGS" --json "$OUT/tdist_64MiB.json"

echo "== 2/3 fusion (ResNet-50 gradients, $ROUNDS rounds)"
"$PYTHON" "$HERE/fusion.py" --np "$NP" --rounds "$ROUNDS" --iters 10 --warmup 3 \
    --mpirun-args "$MPIRUN_ARGS" --json "$OUT/fusion.json"

echo "== 3/3 ResNet-50 $NP ranks x 1 thread: distributed vs no-comm vs 1 rank"
# shellcheck disable=SC2086
mpirun "${ROOT_FLAG[@]}" --oversubscribe -np "$NP" $MPIRUN_ARGS -x PYTHONPATH \
    "$PYTHON" "$HERE/pytorch_synthetic_benchmark.py" --threads-per-rank 1 \
    --batch-size "${BATCH:-8}" --image-size "${IMAGE:-128}" --num-warmup-batches "${WARMUP:-2}" \
    --num-batches-per-iter "${BATCHES_PER_ITER:-2}" --num-iters "${ITERS:-3}" \
    --compare-no-comm --rounds "${RESNET_ROUNDS:-3}" --baseline --json "$OUT/resnet50.json" >"$OUT/resnet50.log"
grep -v '^{' "$OUT/resnet50.log" || true

echo "== verdicts"
"$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
ar = json.loads((out / "allreduce_64MiB.json").read_text())["results"][0]
for impl in ("hvps-mpi", "hvps-ring"):
    if impl in ar:
        print(f"allreduce 64 MiB {impl}: time/raw = {ar[impl]['time_ratio_vs_raw']:.3f} "
              f"(busbw {ar[impl]['busbw_GBps']:.2f} vs raw {ar['raw']['busbw_GBps']:.2f} GB/s)")
td = json.loads((out / "tdist_64MiB.json").read_text())["results"][0]
bw = td["hvps-tdist"]["bw_ratio_vs_tdist"]
print(f"allreduce 64 MiB gloo: hvps/direct throughput = {bw:.3f} -> {'PASS' if bw >= 0.9 else 'FAIL'} (>= 0.9)")
fu = json.loads((out / "fusion.json").read_text())
print(f"fusion: (hvps - backward) / raw = {fu['ratio']:.3f} -> {'PASS' if fu['ratio'] <= 1.25 else 'FAIL'} (<= 1.25)")
rn = json.loads((out / "resnet50.json").read_text())
r = rn["dist_over_no_comm"]["median_of_round_ratios"]
print(f"resnet50 dist/no-comm = {r:.3f} -> {'PASS' if r >= 0.97 else 'FAIL'} (>= 0.97); "
      f"scaling efficiency vs 1 rank = {100 * rn['scaling_efficiency']:.1f}%; "
      f"comm share = {100 * rn['distributed']['comm_share']:.1f}%")
EOF
