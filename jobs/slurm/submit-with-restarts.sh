#!/usr/bin/env bash
# Submit a training job plus RESTARTS standby jobs, each waiting on the previous one
# with --dependency=afternotok: a standby runs only when its predecessor failed (node
# crash, time limit, a rank's error), and resumes from the latest checkpoint in CKPT_DIR.
#   jobs/slurm/submit-with-restarts.sh                       # 1 job + 2 standbys
#   RESTARTS=5 CKPT_DIR=/nfs/ckpt/run1 jobs/slurm/submit-with-restarts.sh -n 8
# Extra arguments go to every sbatch call. Environment (defaults):
#   RESTARTS=2   SCRIPT=jobs/slurm/train-restartable.sbatch   CKPT_DIR, EPOCHS (see SCRIPT)
# Prints the job ids, one per line, first job first.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RESTARTS=${RESTARTS:-2}
SCRIPT=${SCRIPT:-$HERE/train-restartable.sbatch}
prev=$(sbatch --parsable --export=ALL,CHAIN_INDEX=0 "$@" "$SCRIPT" | cut -d';' -f1)
echo "$prev"
for ((i = 1; i <= RESTARTS; i++)); do
    prev=$(sbatch --parsable --dependency="afternotok:$prev" --kill-on-invalid-dep=yes \
        --export=ALL,CHAIN_INDEX=$i "$@" "$SCRIPT" | cut -d';' -f1)
    echo "$prev"
done
