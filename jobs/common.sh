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

# DRY_RUN=1: print each launch command (shell-quoted, one line, prefixed 'dry-run:') instead
# of running it, e.g. to check what a GPU script would start on a machine without GPUs.
run_step() {  # run_step CMD...
    if [ "${DRY_RUN:-0}" = 1 ]; then
        printf 'dry-run:'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

# GPU jobs. NCCL picks its interface and RDMA devices well by itself, so NCCL_SOCKET_IFNAME
# and NCCL_IB_HCA are set only when the user gives them (NIC=ib0 sets NCCL_SOCKET_IFNAME and
# Open MPI's TCP interface, IB_HCA=mlx5_0,mlx5_1 sets NCCL_IB_HCA; NCCL_* variables exported
# by the user pass through as they are, and hvpsrun forwards NCCL_* to every rank). Prints the
# NCCL settings in effect. HVPS_DOCTOR=1 then runs 'hvps doctor --all-ranks' on every rank
# through the launch prefix given (rank 0 prints one table); a failed check stops the job,
# HVPS_DOCTOR=warn reports and goes on.
gpu_prolog() {  # gpu_prolog LAUNCH-PREFIX...
    if [ -n "${NIC:-}" ]; then
        export NCCL_SOCKET_IFNAME=$NIC OMPI_MCA_btl_tcp_if_include=$NIC OMPI_MCA_oob_tcp_if_include=$NIC
    fi
    if [ -n "${IB_HCA:-}" ]; then export NCCL_IB_HCA=$IB_HCA; fi
    local nccl mode=${HVPS_DOCTOR:-0} cli
    nccl=$(env | grep '^NCCL_' | sort | tr '\n' ' ' || true)
    echo "NCCL settings: ${nccl:-none (NCCL picks)}"
    [ "$mode" = 0 ] && return 0
    cli=$(dirname "$HVPS_PYTHON")/hvps
    [ -x "$cli" ] || cli=hvps
    if run_step "$@" "$cli" doctor --all-ranks; then
        return 0
    elif [ "$mode" = warn ]; then
        echo "hvps doctor: a check failed (HVPS_DOCTOR=warn: going on)"
    else
        echo "hvps doctor: a check failed: stopping (see the table above; HVPS_DOCTOR=warn goes on)" >&2
        return 1
    fi
}
