# Sourced by the jobs/ launch scripts: shared defaults (each overridable from the environment).
# HVPS_REPO     checkout with benchmarks/ (default: the one holding this file; under sbatch: $SLURM_SUBMIT_DIR)
# HVPS_PYTHON   interpreter for the ranks (default: $HVPS_REPO/.venv/bin/python, else python3)
# RESULTS_DIR   where JSON results go (default: $HVPS_REPO/results)
# BENCH_ARGS    harness flags (default: a CPU-sized ResNet-50 run of a few minutes)
# HARNESS       the training script (default: benchmarks/pytorch_synthetic_benchmark.py)
# LAUNCHER      inside Slurm, for scripts that start ranks themselves: auto (default), srun or mpirun
if [ -z "${HVPS_REPO:-}" ]; then
    if [ -n "${SLURM_SUBMIT_DIR:-}" ] && [ -d "$SLURM_SUBMIT_DIR/benchmarks" ]; then
        HVPS_REPO=$SLURM_SUBMIT_DIR
    else
        HVPS_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    fi
fi
if [ -z "${HVPS_PYTHON:-}" ]; then
    if [ -x "$HVPS_REPO/.venv/bin/python" ]; then HVPS_PYTHON=$HVPS_REPO/.venv/bin/python; else HVPS_PYTHON=python3; fi
fi
RESULTS_DIR=${RESULTS_DIR:-$HVPS_REPO/results}
BENCH_ARGS=${BENCH_ARGS:---batch-size 8 --image-size 128 --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 5 --threads-per-rank 1}
HARNESS=${HARNESS:-$HVPS_REPO/benchmarks/pytorch_synthetic_benchmark.py}
HVPSRUN=${HVPSRUN:-$(dirname "$HVPS_PYTHON")/hvpsrun}
[ -x "$HVPSRUN" ] || HVPSRUN="$HVPS_PYTHON -m hvps.runner.launch"
export PYTHONPATH="$HVPS_REPO${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$RESULTS_DIR"

# Open MPI flags this machine needs: root, and more ranks than cores on one node.
ompi_local_flags() {  # ompi_local_flags NP
    local flags=""
    [ "$(id -u)" = 0 ] && flags="--allow-run-as-root"
    [ "$1" -gt "$(nproc)" ] && flags="$flags --oversubscribe"
    echo "$flags"
}

# --checkpoint-dir/--resume only when the harness has them (added by the checkpoint work).
checkpoint_args() {  # checkpoint_args DIR
    if [ -n "$1" ] && "$HVPS_PYTHON" "$HARNESS" --help 2>/dev/null | grep -q -- "--checkpoint-dir"; then
        echo "--checkpoint-dir $1 --resume"
    fi
}

# Inside a Slurm allocation: the command prefix that starts the ranks, in the array LAUNCH.
# 'srun --mpi=pmix' when srun's pmix plugin works on this node, else hvpsrun's mpirun inside
# the allocation (Open MPI reads the nodes and slots from Slurm). The rule is hvpsrun's own
# (python -m hvps.runner.slurm_command: 'srun --mpi=list', then one probe step); it prints
# one line saying which path and why. LAUNCHER=srun|mpirun forces one. Extra flags:
# SRUN_ARGS on the srun path, HVPSRUN_ARGS on the mpirun path.
slurm_launch_prefix() {  # slurm_launch_prefix NP
    local launcher
    launcher=$("$HVPS_PYTHON" -m hvps.runner.slurm_command --launcher "${LAUNCHER:-auto}")
    # shellcheck disable=SC2206
    if [ "$launcher" = srun ]; then
        LAUNCH=(srun --mpi=pmix --cpu-bind=none --kill-on-bad-exit=1 ${SRUN_ARGS:-})
    else
        LAUNCH=($HVPSRUN --launcher mpirun -np "$1" ${HVPSRUN_ARGS:-})
    fi
}
