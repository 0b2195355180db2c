#!/usr/bin/env bash
# Build docker/Dockerfile.cpu with podman on a machine that reaches no container registry,
# then check the image: 'hvps doctor' and a 2-rank allreduce against a numpy reference.
#
#   docker/build-local.sh                 # base image (if missing), build, check
#   docker/build-local.sh --check-only    # check an image built before
#   docker/build-local.sh --rebase --no-cache   # everything from scratch (base image too)
#   docker/build-local.sh --help
#
# Steps (each logged with its wall time):
#   1. base: localhost/debian:bookworm, made with 'debootstrap --variant=minbase bookworm'
#      from Debian's mirror and 'podman import' (skipped when the image exists; --rebase
#      makes it again). The Dockerfile installs python3 + python3-venv from apt on it.
#   2. build: 'podman build' with --build-arg BASE=<that image>; pip inside the build reads
#      this machine's wheel directory and file:// indexes (bind-mounted read-only at the same
#      paths) for torch's CPU build and the pinned packages, PyPI for the rest.
#   3. check: 'hvps doctor' (or, where this checkout has no doctor yet, 'hvps --version' and
#      'python -m hvps.runner.mpi_discovery'), then hvpsrun -np 2 with an allreduce whose
#      result is compared with numpy on every rank; then the same across two containers on a
#      podman network (ssh between them, as docker/compose.yaml does). All as the non-root user.
#
# Environment (defaults):
#   IMAGE=localhost/hvps:cpu   BASE_IMAGE=localhost/debian:bookworm   SUITE=bookworm
#   MIRROR=http://deb.debian.org/debian   WORK=/var/tmp/hvps-build (rootfs, logs)
#   WHEELS=/opt/wheels   PIP_INDEXES="/opt/pypi/simple /opt/pypi-more/simple" (local dirs;
#   those that exist are mounted and handed to pip)   TORCH_INDEX_URL='' (the Dockerfile's
#   default is PyTorch's CPU index, unreachable here)   PIP_CERT='' (a CA bundle file for
#   pip in the build, e.g. where a TLS-inspecting proxy signs PyPI's certificate; mounted)
#   RUNTIME='' (auto: runc where crun cannot run, i.e. on a cgroup v1/v2 hybrid host)
#   SHM_SIZE=1g (the checks' /dev/shm; see docker/README.md)
#   SOURCE=HEAD: the build context is 'git archive SOURCE' (any commit-ish), so the image holds
#   committed code only; SOURCE=worktree builds from the working tree as it is, SOURCE=DIR
#   from a prepared directory (a checkout or an unpacked sdist with docker/ in it).
#   DOCKERFILE=docker/Dockerfile.cpu (relative to the context; docker/Dockerfile.cuda builds on
#   this base too, as a smoke test of that file: torch then comes from WHEELS, here a CPU build)
# Needs root (debootstrap, podman's rootful storage) and the Debian packages podman buildah
# uidmap debootstrap (plus runc on hybrid-cgroup hosts): --install-deps runs apt-get for them.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${IMAGE:-localhost/hvps:cpu}
BASE_IMAGE=${BASE_IMAGE:-localhost/debian:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
WORK=${WORK:-/var/tmp/hvps-build}
WHEELS=${WHEELS:-/opt/wheels}
PIP_INDEXES=${PIP_INDEXES:-/opt/pypi/simple /opt/pypi-more/simple}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
PIP_CERT=${PIP_CERT:-}
RUNTIME=${RUNTIME:-}
SHM_SIZE=${SHM_SIZE:-1g}
SOURCE=${SOURCE:-HEAD}
DOCKERFILE=${DOCKERFILE:-docker/Dockerfile.cpu}

check_only=0 rebase=0 install_deps=0 no_cache=0
for arg in "$@"; do
    case $arg in
        -h|--help) usage; exit 0 ;;
        --check-only) check_only=1 ;;
        --rebase) rebase=1 ;;
        --install-deps) install_deps=1 ;;
        --no-cache) no_cache=1 ;;
        *) echo "build-local.sh: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
    esac
done

log() { echo "[build-local $(date -u +%H:%M:%S)] $*"; }
timed() {  # timed LABEL CMD...: run CMD, log its wall time
    local label=$1 t0=$SECONDS; shift
    log "$label: $*"
    "$@"
    log "$label: done in $((SECONDS - t0)) s"
}

if [ "$install_deps" = 1 ]; then
    timed apt apt-get update -q
    timed apt env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        podman buildah uidmap debootstrap runc
fi
for tool in podman; do
    command -v "$tool" >/dev/null || { echo "build-local.sh: $tool missing (try --install-deps)" >&2; exit 1; }
done

# crun (podman's default on Debian) refuses hosts that mount cgroup v1 controllers and a
# cgroup2 hierarchy side by side ('cgroups in hybrid mode not supported'); runc copes.
if [ -z "$RUNTIME" ] && grep -q ' /sys/fs/cgroup/unified cgroup2 ' /proc/mounts && command -v runc >/dev/null; then
    RUNTIME=runc
fi
PODMAN=(podman)
[ -n "$RUNTIME" ] && PODMAN+=(--runtime "$RUNTIME")
# Without CAP_SYS_RESOURCE (e.g. some VM sandboxes) podman's default rlimits (nofile and
# nproc 1048576) cannot be set: ask for what this shell already has.
ULIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")
log "podman $(podman --version | awk '{print $3}'), runtime ${RUNTIME:-default}, storage $(podman info --format '{{.Store.GraphDriverName}}')"

make_base() {
    command -v debootstrap >/dev/null || { echo "build-local.sh: debootstrap missing (try --install-deps)" >&2; exit 1; }
    local rootfs=$WORK/rootfs
    rm -rf "$rootfs"
    mkdir -p "$WORK"
    timed debootstrap debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    timed import sh -c "tar -C '$rootfs' -c . | podman import - '$BASE_IMAGE' >/dev/null"
    rm -rf "$rootfs"
}

if [ "$check_only" = 0 ]; then
    if [ "$rebase" = 1 ] || ! podman image exists "$BASE_IMAGE"; then
        make_base
    else
        log "base: $BASE_IMAGE exists (--rebase makes it again)"
    fi
    BUILD_ARGS=(--build-arg "BASE=$BASE_IMAGE" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    VOLUMES=()
    if [ -d "$WHEELS" ]; then
        VOLUMES+=(-v "$WHEELS:$WHEELS:ro")
        BUILD_ARGS+=(--build-arg "PIP_FIND_LINKS=$WHEELS")
    fi
    indexes=""
    for d in $PIP_INDEXES; do
        [ -d "$d" ] || continue
        VOLUMES+=(-v "$(dirname "$d"):$(dirname "$d"):ro")  # the index's pages link to ../files/
        indexes="$indexes file://$d"
    done
    [ -n "$indexes" ] && BUILD_ARGS+=(--build-arg "PIP_EXTRA_INDEX_URL=${indexes# }")
    if [ -n "$PIP_CERT" ] && [ -f "$PIP_CERT" ]; then
        VOLUMES+=(-v "$PIP_CERT:/run/hvps-build-ca.crt:ro")
        BUILD_ARGS+=(--build-arg "PIP_CERT=/run/hvps-build-ca.crt")
    fi
    if [ "$SOURCE" = worktree ]; then
        context=$REPO
    elif [ -d "$SOURCE" ]; then
        context=$(cd "$SOURCE" && pwd)
    else
        context=$WORK/context
        rm -rf "$context" && mkdir -p "$context"
        git -C "$REPO" -c tar.umask=0022 archive --format=tar "$SOURCE" | tar -x -C "$context"
        log "context: git archive $SOURCE ($(git -C "$REPO" rev-parse --short "$SOURCE"))"
    fi
    # The image installs hvps from setup.cfg (not editable): a subpackage missing from its
    # 'packages' list would be missing from the image, so say so before building.
    missing=$(cd "$context" && for f in $(find hvps -mindepth 2 -name __init__.py); do
        pkg=$(dirname "$f" | tr / .)
        grep -qx "    $pkg" setup.cfg || echo "$pkg"
    done)
    if [ -n "$missing" ]; then
        echo "build-local.sh: setup.cfg's [options] packages lacks:" $missing "- a non-editable" \
            "install (this image) would not contain them; add them to setup.cfg" >&2
        exit 1
    fi
    [ "$no_cache" = 1 ] && BUILD_ARGS+=(--no-cache)
    timed build "${PODMAN[@]}" build --format docker --network host "${ULIMITS[@]}" "${VOLUMES[@]}" "${BUILD_ARGS[@]}" \
        -f "$context/$DOCKERFILE" -t "$IMAGE" "$context"
fi

podman image exists "$IMAGE" || { echo "build-local.sh: no image $IMAGE (build it first)" >&2; exit 1; }
log "image $IMAGE: $(podman image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1 / 1e6}')"

RUN=("${PODMAN[@]}" run --rm --network none --shm-size "$SHM_SIZE" "${ULIMITS[@]}" "$IMAGE")
if "${RUN[@]}" hvps doctor --help >/dev/null 2>&1; then
    timed doctor "${RUN[@]}" hvps doctor
else
    log "doctor: this image's hvps has no 'doctor' subcommand; showing the version and the MPI found instead"
    timed version "${RUN[@]}" sh -c 'hvps --version; python -m hvps.runner.mpi_discovery; mpirun --version | head -n 1'
fi
timed allreduce "${RUN[@]}" hvpsrun -np 2 python -c '
import numpy as np
import hvps
hvps.init()
rank, size = hvps.rank(), hvps.size()
x = np.arange(1 << 20, dtype=np.float32) * (rank + 1)
got = hvps.allreduce(x, op=hvps.Sum, name="check")
want = np.arange(1 << 20, dtype=np.float32) * sum(r + 1 for r in range(size))
assert np.array_equal(got, want), (rank, got[:4], want[:4])
print(f"rank {rank}/{size}: allreduce of 4 MiB float32 matches numpy", flush=True)
hvps.shutdown()
'

# Two emulated nodes, as docker/compose.yaml arranges them: a key volume filled by
# 'hvps-worker-sshd keygen', node1 and node2 running only sshd (non-root, port 2222), and a
# launcher whose mpirun reaches both over ssh and starts one rank on each.
tag=hvps-build-local-$$
cleanup() {
    podman rm -f "$tag-node1" "$tag-node2" >/dev/null 2>&1 || true
    podman volume rm -f "$tag-keys" >/dev/null 2>&1 || true
    podman network rm -f "$tag" >/dev/null 2>&1 || true
}
trap cleanup EXIT
podman network create "$tag" >/dev/null
podman volume create "$tag-keys" >/dev/null
NODE=("${PODMAN[@]}" run --network "$tag" --shm-size "$SHM_SIZE" "${ULIMITS[@]}" -v "$tag-keys:/etc/hvps-ssh")
"${NODE[@]}" --rm "$IMAGE" hvps-worker-sshd keygen
for n in node1 node2; do
    "${NODE[@]}" -d --name "$tag-$n" --hostname "$n" --network-alias "$n" "$IMAGE" hvps-worker-sshd >/dev/null
done
for n in node1 node2; do  # sshd listening?
    for _ in $(seq 30); do podman logs "$tag-$n" 2>&1 | grep -q 'listening on 0.0.0.0 port 2222' && break; sleep 0.5; done
done
timed two-nodes "${NODE[@]}" --rm --hostname launcher "$IMAGE" hvpsrun -np 2 -H node1:1,node2:1 python -c '
import socket
import numpy as np
import hvps
hvps.init()
x = np.full(1 << 20, hvps.rank() + 1, dtype=np.float32)
got = hvps.allreduce(x, op=hvps.Sum, name="check")
assert np.all(got == sum(range(1, hvps.size() + 1))), got[:4]
print(f"rank {hvps.rank()}/{hvps.size()} on {socket.gethostname()}: allreduce matches numpy", flush=True)
hvps.shutdown()
'
log "all checks passed"
