#!/usr/bin/env bash
# hvps device check on one GPU (issue 3); finishes in under 8 minutes on one H200.
#
#   bash benchmarks/gpu_check.sh             # on the GPU machine, from anywhere
#   bash benchmarks/gpu_check.sh --dry-run   # same steps on CPU, tiny sizes, existing .venv
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh   # same as --dry-run
#
# Everything goes to ${OUT:-results/gpu_check}: gpu_check.md (one table row per
# step: exit status, seconds, result), gpu_check.json, the benchmarks' JSON, and
# one log per step, doctor.json (9 files). Steps, each under its own `timeout`; a failing step
# is recorded and the next one runs; the exit status is 1 when any step failed:
#   setup  GPU: .venv-gpu (python3 -m venv; python3's packages stay visible),
#          torch 2.13.0 from the cu128 index, else from the default index, else
#          python3's own torch; `pip install -e .[gpu,dev]`, offline `--no-deps`.
#          Dry run: the existing .venv, nothing installed.
#   a      python -m pytest -q tests/test_gpu.py (1 rank)
#   b      ResNet-50 harness, 1 rank (mpirun -np 1 when there is an mpirun),
#          --cuda --amp --channels-last --batch-size 256 --compare-plain,
#          HVPS_BACKEND=tdist: hvps vs plain PyTorch images/s, target >= 0.97
#   c      benchmarks/allreduce.py: a 256 MiB float32 allreduce, world size 1, hvps
#          (HVPS_BACKEND=tdist, NCCL) vs torch.distributed.all_reduce, 3 rounds
#   d      nvidia-smi, package versions, `hvps doctor --json` (node checks: driver
#          against torch's CUDA, persistence, ECC, clocks, topology, NCCL) into doctor.json
# Step time limits (seconds) come from T_SETUP T_TEST T_RESNET T_ALLREDUCE T_INFO;
# GPU_CHECK_BACKEND overrides HVPS_BACKEND=tdist; PIP_FIND_LINKS / PIP_NO_INDEX
# point pip at carried wheels.
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
STEPS=$WORK/steps.tsv PYFILE=$WORK/python
: >"$STEPS"
export ROOT OUT PYFILE CPU_MODE PYTHONUNBUFFERED=1 HVPS_BACKEND=${GPU_CHECK_BACKEND:-tdist}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # Open MPI refuses root otherwise

if [ "$CPU_MODE" = 1 ]; then
  export MODE="cpu dry run"
  BENCH=(--amp --channels-last --batch-size 8 --image-size 64 --compare-plain --rounds 2
         --num-warmup-batches 1 --num-batches-per-iter 1 --num-iters 2 --threads-per-rank 1)
  ALLREDUCE=(--device cpu --sizes 8MiB --rounds 2 --iters-large 10)
  RESNET_JSON=resnet50_cpu.json ALLREDUCE_JSON=allreduce_gloo.json
else
  export MODE=gpu
  # ~0.1 s a batch on an H200: 6 phases x 40 batches plus warm-up is about a minute
  BENCH=(--cuda --amp --channels-last --batch-size 256 --compare-plain --rounds 3
         --num-warmup-batches 5 --num-batches-per-iter 10 --num-iters 4 --threads-per-rank 4)
  ALLREDUCE=(--device cuda --sizes 256MiB --rounds 3 --iters-large 20)
  RESNET_JSON=resnet50_cuda.json ALLREDUCE_JSON=allreduce_nccl.json
fi

# run_step NAME LIMIT_S LOGNAME CMD...: header, CMD under timeout, output to $OUT/LOGNAME
# and stdout, one row (name, exit status, seconds, log) in $STEPS. Never fails.
run_step() {
  local name=$1 limit=$2 logname=$3 t0=$SECONDS rc
  local log=$OUT/$logname
  shift 3
  printf '\n==== [%s] %s (limit %s s) ====\n+ %s\n' "$(date +%T)" "$name" "$limit" "$*" | tee -a "$log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "---- timed out after $limit s" | tee -a "$log"; fi
  printf '==== %s: exit status %s after %s s\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$logname" >>"$STEPS"
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

echo "hvps device check ($MODE): output in $OUT"
rm -f "$OUT/$RESNET_JSON" "$OUT/$ALLREDUCE_JSON" "$OUT/gpu_check.md" "$OUT/gpu_check.json"  # no stale results
for log in setup_env test_gpu resnet50 allreduce; do : >"$OUT/$log.log"; done
run_step "setup" "${T_SETUP:-130}" setup_env.log bash -c setup_env
PY=$(cat "$PYFILE" 2>/dev/null || command -v python3)

run_step "a. tests/test_gpu.py" "${T_TEST:-70}" test_gpu.log \
  "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py

LAUNCH=()
if command -v mpirun >/dev/null; then
  LAUNCH=(mpirun -np 1)
  if mpirun --version 2>&1 | grep -q "Open MPI"; then
    LAUNCH+=(--oversubscribe --bind-to none --map-by slot -x HVPS_BACKEND -x PYTHONUNBUFFERED)
  fi
fi
run_step "b. ResNet-50 hvps vs plain PyTorch" "${T_RESNET:-170}" resnet50.log \
  ${LAUNCH[@]+"${LAUNCH[@]}"} "$PY" benchmarks/pytorch_synthetic_benchmark.py "${BENCH[@]}" --json "$OUT/$RESNET_JSON"

run_step "c. allreduce hvps vs torch.distributed" "${T_ALLREDUCE:-45}" allreduce.log \
  "$PY" benchmarks/allreduce.py --np 1 --impls tdist,hvps-tdist "${ALLREDUCE[@]}" \
  --mpirun "$(command -v mpirun || echo none)" --json "$OUT/$ALLREDUCE_JSON"

run_step "d. nvidia-smi and versions" "${T_INFO:-30}" setup_env.log bash -c env_info

# The report: gpu_check.md (table) and gpu_check.json, from the step rows and the JSON.
REPORT_PY=$PY
"$REPORT_PY" -c 'pass' 2>/dev/null || REPORT_PY=python3
"$REPORT_PY" - "$STEPS" "$OUT" "$MODE" "$RESNET_JSON" "$ALLREDUCE_JSON" <<'EOF'
import json, os, re, sys, time
from pathlib import Path

steps_tsv, out, mode, resnet_name, allreduce_name = sys.argv[1:]
out = Path(out)

def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception:
        return None

def lines(log):
    try:
        return (out / log).read_text(errors="replace").splitlines()
    except OSError:
        return []

resnet, allreduce = load(resnet_name), load(allreduce_name)
steps = []
for row in Path(steps_tsv).read_text().splitlines():
    name, rc, secs, log = row.split("\t")
    steps.append({"step": name, "exit_status": int(rc), "seconds": int(secs), "log": log})

def last_error(log):
    hits = [l.strip() for l in lines(log) if re.search(r"error|exception|timed out|errno|not found", l, re.I)]
    return hits[-1][:300] if hits else "see log"

def result_of(step):
    name, log = step["step"], step["log"]
    if name == "setup":
        return "; ".join(l for l in lines(log) if l.startswith(("torch:", "hvps:"))) or "see log"
    if name.startswith("a."):
        hits = [l.strip("= ") for l in lines(log) if re.search(r"\b(passed|failed|skipped|error|errors|no tests ran)\b|not found", l)]
        return hits[-1] if hits else "see log"
    if name.startswith("b."):
        if not resnet or "ratio_vs_plain" not in resnet:
            return f"no {resnet_name}: {last_error(log)}"
        met = "met" if resnet["ratio_vs_plain"] >= 0.97 else "NOT met"
        return (f"hvps {resnet['hvps_img_sec_per_rank']:.1f} img/s, plain {resnet['plain_img_sec_per_rank']:.1f} img/s, "
                f"ratio {resnet['ratio_vs_plain']:.3f} (target >= 0.97: {met})")
    if name.startswith("c."):
        if not isinstance(allreduce, dict):
            return f"no {allreduce_name}: {last_error(log)}"
        rows = allreduce.get("results") or [{}]
        row = rows[-1]
        if "hvps-tdist" not in row or "tdist" not in row:
            return f"see {allreduce_name}: {allreduce.get('errors')}"
        return (f"{row['size']}: torch.distributed {row['tdist']['algbw_GBps']:.1f} GB/s algbw, hvps "
                f"{row['hvps-tdist']['algbw_GBps']:.1f} GB/s, time ratio hvps/direct "
                f"{row['hvps-tdist']['time_ratio_vs_tdist']:.3f}")
    if name.startswith("d."):
        hits = [l for l in lines(log) if l.startswith("torch ") and "CUDA" in l]
        return hits[-1] if hits else "see log"
    return "see log"

for s in steps:
    s["result"] = result_of(s)
md = [f"# hvps device check ({mode})", "",
      f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}; HVPS_BACKEND={os.environ.get('HVPS_BACKEND')}; logs and JSON beside this file.", "",
      "| step | exit status | seconds | result | log |", "| --- | --- | --- | --- | --- |"]
md += [f"| {s['step']} | {s['exit_status']}{' (timed out)' if s['exit_status'] in (124, 137) else ''} | {s['seconds']} "
       f"| {s['result'].replace('|', '/')} | {s['log']} |" for s in steps]
summary = {"mode": mode, "steps": steps, "all_steps_passed": all(s["exit_status"] == 0 for s in steps),
           "resnet50_json": resnet_name, "allreduce_json": allreduce_name}
if resnet and "ratio_vs_plain" in resnet:
    summary.update({k: resnet[k] for k in ("hvps_img_sec_per_rank", "plain_img_sec_per_rank", "ratio_vs_plain")})
    summary["ratio_target_met"] = resnet["ratio_vs_plain"] >= 0.97
    md += ["", f"ResNet-50, 1 rank, batch {resnet['batch_size']}, {resnet['image_size']} px, {resnet['device']}, "
           f"bf16 autocast {resnet['amp_bf16']}, channels_last {resnet['channels_last']}: per-round hvps/plain ratios "
           + ", ".join(f"{r:.3f}" for r in resnet["vs_plain"]["per_round"]) + "."]
    for g in resnet.get("gpu") or ():
        def f(v, spec=".0f"):
            return "n/a" if v is None else format(v, spec)
        md.append(f"GPU {g['device']} ({g['name']}): torch max allocated {f(g['torch_max_memory_allocated_mib'])} MiB; "
                  f"NVML memory used {f(g['memory_used_mib'])} of {f(g['memory_total_mib'])} MiB, utilisation "
                  f"{f(g['utilization_pct'])}% mean, {f(g['utilization_pct_max'])}% max"
                  + (f" ({g['nvml_reason']})" if g.get("nvml_reason") else "") + ".")
        summary["gpu"] = resnet["gpu"]
    if resnet.get("gpu") is None and resnet.get("gpu_reason"):
        md.append(f"GPU: none ({resnet['gpu_reason']}).")
(out / "gpu_check.md").write_text("\n".join(md) + "\n")
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print("\n".join(md))
sys.exit(0 if summary["all_steps_passed"] else 1)
EOF
