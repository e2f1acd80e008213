#!/usr/bin/env bash
# The GPU suite: one command for a machine with a CUDA GPU (an H100 here), run from a clean checkout.
#
#   bench/gpu_check.sh [STAGE...]   summary.md, logs.tgz (every log) and the built extension under $OUT
#                                   (or bench/out/ when OUT is unset); no STAGE: all of them, in this order
#
# A GPU machine may be held for less time than the whole suite takes: name the stages a call should run (e.g.
# `env build import tests`, then `sanitizer bench transfer`); a stage that needs the extension builds it first
# unless it imports with CUDA.
# env, build and import run first; the other stages run in the order named, so a short hold names first what
# matters most (e.g. `env build transfer bench cudatests arena`). DRY_RUN=1 prints that order (a build
# assumed needed) and runs nothing.
# Stages, each logged, timed and recorded in summary.md; a failing stage does not stop the next:
#   env        nvidia-smi, the machine's own torch and nvcc
#   build      pip install -e . --no-build-isolation --no-deps with that torch (fallback: setup.py build_ext --inplace)
#   tests      pytest tests: the whole suite, the CUDA twins first (`-k cuda`: most have never run on a GPU, and a
#              run cut short should have their results), then the rest (`-k "not cuda"`, the CLI's tests last)
#   cudatests  the CUDA twins alone (`-k cuda`, about 70 s on an H100): for a hold too short for the whole suite
#   ctest      the CMake build with PYENGINE_WITH_CUDA=ON and its C++ tests
#   sanitizer  compute-sanitizer memcheck (and racecheck) on a small case calling every op on CUDA
#   bench      bench/bench_fused_adamw.py --full --cuda: ours vs stock, GB/s vs a measured device copy
#   kernel_ab  bench/cuda_kernel_ab.py: the update kernel's block shape (chunk 2048 as built, 16384, 4096, 1024; 512
#              threads) against each other and a device copy, N = 32M and 256M, bits checked equal first (plain nvcc)
#   nvtx       the NVTX ranges of a short `python -m pyengine train` on the GPU: nsys's NVTX summary where nsys works,
#              else ncu's NVTX filter (ncu profiles only kernels launched inside the named range: kernels profiled
#              inside pyengine/worker0/forward_backward+transfer, none inside a range that does not exist)
#   transfer   bench/bench_transfer.py --batch 64 256 1024: streamer D2H bandwidth vs raw pinned copy, backward
#              overlap with early copies of large gradients and with whole buckets only (paired), a profiler copy
#              timeline and Chrome traces in logs.tgz, hybrid with 4 workers on the GPU vs single-replica training
#              (the host's ops on every intra-op thread, then on 4 and 8);
#              float32 and bfloat16 gradient slots (--grad-dtype: half the bytes to copy)
#   pipeline   bench/bench_pipeline.py --device cuda:0: S stages as S workers on one GPU (each its own stream),
#              S in {2, 4}, M in {1, 4, 16}, 1F1B and GPipe, samples/s and bubble vs single-device training
#   arena      bench/bench_arena.py: the host update on the pinned arena's huge pages (cudaHostRegister) vs
#              cudaHostAlloc's 4 KiB pages vs torch tensors, and D2H GB/s into each pinned kind
# DEADLINE_S=N makes every stage end in time for the summary within N seconds of the start. Needs no network.
# PYTHON picks the interpreter (default python3: the one holding that machine's torch).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
ALL_STAGES=(env build import tests cudatests ctest sanitizer bench kernel_ab nvtx transfer pipeline arena)
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=("${ALL_STAGES[@]}")
for s in "${STAGES[@]}"; do
  [[ " ${ALL_STAGES[*]} " == *" $s "* ]] || { echo "unknown stage '$s' (stages: ${ALL_STAGES[*]})" >&2; exit 2; }
done
wants() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }
PYTHON=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-$(nproc)} PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.md"
SCRATCH=$(mktemp -d)
LOGS="$SCRATCH/logs"
mkdir -p "$LOGS"
trap 'rm -rf "$SCRATCH"' EXIT
declare -a ROWS=()
STAGE_PID=
CURRENT=

# stage NAME LOG TIMEOUT_S COMMAND...: runs the command, appends its output to LOG, records status and time.
stage() {
  local name=$1 log=$2 limit=$3
  shift 3
  if [[ -n ${DEADLINE_S:-} ]]; then  # stay inside the time the machine is held: end each stage 30 s before it
    local left=$((DEADLINE_S - SECONDS - 30))
    (( left < limit )) && limit=$left
    (( limit < 1 )) && { ROWS+=("| $name | SKIPPED (no time left) | 0 | |"); return; }
  fi
  echo "== $name: $*" | tee -a "$log"
  STAGE_START=$SECONDS CURRENT=$name CURRENT_LOG=$log
  # bash -c: the exported shell functions run too. In the background, waited for: a signal to this script then
  # runs its trap at once, which stops the stage (timeout passes the signal on to the stage's processes); -k: a
  # stage that ignores the signal is killed 10 s later.
  timeout -k 10 "$limit" bash -c '"$@"' stage "$@" >>"$log" 2>&1 &
  STAGE_PID=$!
  wait "$STAGE_PID"
  local rc=$?
  STAGE_PID= CURRENT=
  local status=ok
  [[ $rc -ne 0 ]] && status="FAILED (rc=$rc$([[ $rc -eq 124 ]] && echo ", timed out after ${limit}s"))"
  ROWS+=("| $name | $status | $((SECONDS - STAGE_START)) | $(basename "$log") |")
  echo "== $name: $status" | tee -a "$log"
  tail -n 5 "$log"
  finish  # summary.md and logs.tgz after every stage: a call cut short still brings back what ran
}

# Stopped from outside (the machine's hold ending, Ctrl-C): the running stage is stopped, recorded as such, and the
# summary and logs are written before the scratch folder goes.
on_signal() {
  trap - TERM INT
  if [[ -n $STAGE_PID ]]; then
    kill -TERM "$STAGE_PID" 2>/dev/null
    wait "$STAGE_PID" 2>/dev/null
    ROWS+=("| $CURRENT | FAILED (stopped by a signal) | $((SECONDS - STAGE_START)) | $(basename "$CURRENT_LOG") |")
  fi
  finish
  exit 143
}

build() {
  "$PYTHON" -m pip install -e . --no-build-isolation --no-deps -v && return 0
  echo "pip install -e failed; falling back to setup.py build_ext --inplace"
  "$PYTHON" setup.py build_ext --inplace
}

check_build() {
  "$PYTHON" -c 'import torch, pyengine.ops as ops
print("pyengine._C.with_cuda =", ops._C.with_cuda, "| cpu isa", ops._C.cpu_isa())
assert ops._C.with_cuda, "pyengine was built without CUDA"
assert torch.cuda.is_available(), "torch sees no GPU"
for dev in ("cpu", "cuda"):  # an error message that formats numbers (a static libstdc++ crashed exactly here)
    try:
        ops.mean_grad_adamw_(torch.zeros(5, device=dev), torch.zeros(4, device=dev), torch.zeros(5, device=dev),
                             [torch.zeros(5, device=dev)], lr=1e-3, step=1)
    except ValueError as e:
        assert "must have 5 elements" in str(e), e
    else:
        raise AssertionError("a bad call was accepted")
print("errors raise cleanly on cpu and cuda")'
}

cat >"$SCRATCH/sanitize_case.py" <<'EOF'
# A small case through every op on CUDA: odd length, an unaligned view (scalar path), mixed gradient dtypes, every
# option. Run under compute-sanitizer; the caching allocator is off so every buffer is its own allocation.
import torch
import pyengine.ops as ops

dev = torch.device("cuda")
n = 100003
for offset in (0, 1):  # offset 1: the tensors start 4 bytes past a 16-byte boundary
    def buf(dtype=torch.float32, fill=None):
        t = torch.randn(n + offset, device=dev)[offset:].to(dtype)
        return t if fill is None else t.fill_(fill)
    p, m, v, vmax = buf(), buf(fill=0.0), buf(fill=0.0), buf(fill=0.0)
    grads = [buf(), buf(torch.bfloat16), buf(torch.float16)]
    out = torch.empty(n + offset, device=dev, dtype=torch.bfloat16)[offset:]
    for step in (1, 2):
        ops.mean_grad_adamw_clipped_(p, m, v, grads, lr=1e-3, weight_decay=0.01, step=step, amsgrad=True,
                                     max_exp_avg_sq=vmax, grad_scale=torch.full((1,), 2.0, device=dev),
                                     found_inf=torch.zeros(1, device=dev), weights=[0.5, 0.25, 0.25], param_out=out,
                                     max_grad_norm=1.0)
        ops.mean_grad_adamw_(p, m, v, grads, lr=1e-3, step=step + 2, param_out=out)
    norm = ops.mean_grad_norm(grads)
    params = [buf(), torch.randn(33, device=dev)]
    ops.mean_grad_adamw_multi_(params, [torch.zeros_like(x) for x in params], [torch.zeros_like(x) for x in params],
                               [[torch.randn_like(x) for x in params] for _ in range(2)], lr=1e-3, step=1,
                               max_grad_norm=1.0)
    ops.mean_grad_norm_multi([[torch.randn_like(x) for x in params] for _ in range(2)])
torch.cuda.synchronize()
assert torch.isfinite(p).all() and torch.isfinite(norm.norm), "non-finite result"
print("sanitize case done, norm", norm.norm.item())
EOF

sanitize() {
  command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not on PATH"; return 127; }
  local rc=0
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$PYTHON" "$SCRATCH/sanitize_case.py" || rc=1
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck --error-exitcode 1 \
    "$PYTHON" "$SCRATCH/sanitize_case.py" || rc=1
  return $rc
}

run_tests() {  # the CUDA twins first, then everything else (the CLI's last: its torchrun tests take 15-80 s each on
  # a GPU machine, and a stage cut short should have run the engine's tests); fails if either part fails
  local rc=0 files
  "$PYTHON" -m pytest tests -q -rfE -p no:cacheprovider -k cuda || rc=1
  files=$(ls tests/test_*.py | grep -v '^tests/test_cli.py$')
  "$PYTHON" -m pytest $files tests/test_cli.py -q -rfE -p no:cacheprovider -k "not cuda" || rc=1
  return $rc
}

nvtx_check() {
  local train=(-m pyengine train --devices cuda:0 --workers 2 --steps 3)
  if command -v nsys >/dev/null; then
    # the C++ transfer's ranges (copies into the slots, copies back, host waits) and the engine's phases
    if nsys profile -t nvtx,cuda -o "$SCRATCH/pyengine" --force-overwrite true "$PYTHON" "${train[@]}" \
        --out "$SCRATCH/nsys-run" && nsys stats -r nvtx_sum "$SCRATCH/pyengine.nsys-rep" | tee "$SCRATCH/nvtx.txt"; then
      local name missing=0
      for name in "pyengine/d2h grads" "pyengine/h2d weights" "pyengine/wait" "pyengine/worker0/"; do
        grep -q "$name" "$SCRATCH/nvtx.txt" && echo "range seen: $name" || { echo "no range: $name"; missing=1; }
      done
      return $missing
    fi
    echo "nsys gave no report; checking the ranges with ncu's NVTX filter instead"
  fi
  command -v ncu >/dev/null || { echo "neither nsys nor ncu on PATH"; return 127; }
  # ncu's filter syntax: a push/pop range ends in '/', and '/' also separates nested ranges, while pyengine's range
  # names contain '/'. Never run on a GPU yet, so each form below is tried in turn (the first that profiles kernels
  # wins; the log says which); the negative control then uses the same form with a name no range has. In the regex
  # forms '.' stands for the '/' inside the name.
  local form inside=0 absent runs=0
  for form in 'regex:.*worker0.forward_backward.*/' 'regex:pyengine\/worker0\/forward_backward.*/' \
              'regex:pyengine/worker0/forward_backward'; do
    runs=$((runs + 1))
    inside=$(ncu --nvtx --nvtx-include "$form" --launch-count 3 --section LaunchStats "$PYTHON" "${train[@]}" \
      --out "$SCRATCH/ncu-run$runs" 2>&1 | tee -a /dev/stderr | grep -c "==PROF== Profiling")  # -a: the log stays
    echo "ncu --nvtx-include '$form': $inside kernels profiled"
    [[ $inside -gt 0 ]] && break
  done
  absent=$(ncu --nvtx --nvtx-include "${form//forward_backward/no-such-range}" --launch-count 3 --section LaunchStats \
    "$PYTHON" "${train[@]}" --out "$SCRATCH/ncu-absent" 2>&1 | grep -c "==PROF== Profiling")
  echo "kernels profiled inside pyengine/worker0/forward_backward+transfer: $inside (filter '$form'); inside a" \
       "missing range ('${form//forward_backward/no-such-range}'): $absent"
  [[ $inside -gt 0 && $absent -eq 0 ]]
}

export -f build check_build run_tests sanitize nvtx_check
export PYTHON SCRATCH
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the extension built in place, whatever the install did
NEEDS_EXT=(tests cudatests sanitizer bench nvtx transfer pipeline arena)
needs_ext=0
for s in "${NEEDS_EXT[@]}"; do wants "$s" && needs_ext=1; done
if ! wants build && (( needs_ext )) && { [[ -n ${DRY_RUN:-} ]] || ! check_build >/dev/null 2>&1; }; then
  STAGES+=(build)  # a later stage needs the extension and none that imports with CUDA is here
fi

run_stage() {
  case $1 in
    env) stage env "$LOGS/env.log" 120 bash -c "nvidia-smi; nvcc --version || /usr/local/cuda/bin/nvcc --version; \
      $PYTHON -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; \
      $PYTHON -m pip list 2>/dev/null | grep -i -E '^(torch|pytest|pybind11|ninja|setuptools|wheel|cmake) '; \
      cmake --version | head -n 1" ;;
    build) stage build "$LOGS/build.log" 600 build ;;
    import) stage import "$LOGS/build.log" 120 check_build ;;
    tests) stage tests "$LOGS/tests.log" 900 run_tests ;;
    cudatests) stage cudatests "$LOGS/tests.log" 600 "$PYTHON" -m pytest tests -q -rfE -p no:cacheprovider -k cuda ;;
    ctest) stage ctest "$LOGS/ctest.log" 900 \
      env PYTHON="$PYTHON" BUILD_DIR="$SCRATCH/build-cmake" JOBS="$MAX_JOBS" \
      tests/cpp/run_ctest.sh -DPYENGINE_WITH_CUDA=ON ;;
    sanitizer) stage sanitizer "$LOGS/sanitizer.log" 900 sanitize ;;
    bench) stage bench "$LOGS/bench.log" 900 "$PYTHON" bench/bench_fused_adamw.py --full --cuda \
      --out "$LOGS/bench_cuda.md" ;;
    kernel_ab) stage kernel_ab "$LOGS/kernel_ab.log" 600 "$PYTHON" bench/cuda_kernel_ab.py \
      --out "$LOGS/kernel_ab.md" ;;
    nvtx) stage nvtx "$LOGS/nvtx.log" 300 nvtx_check ;;
    transfer) stage transfer "$LOGS/transfer.log" 900 "$PYTHON" bench/bench_transfer.py --device cuda:0 \
      --batch 64 256 1024 --grad-dtype float32 bfloat16 --host-threads 4 8 --out "$LOGS/transfer.md" \
      --trace-dir "$LOGS" ;;
    pipeline) stage pipeline "$LOGS/pipeline.log" 600 bash -c "set -o pipefail; \"$PYTHON\" \
      bench/bench_pipeline.py --device cuda:0 --width 4096 --batch 512 | tee \"$LOGS/pipeline.md\"" ;;
    arena) stage arena "$LOGS/arena.log" 300 "$PYTHON" bench/bench_arena.py --threads 1 16 --out "$LOGS/arena.md" ;;
  esac
}

# The order: env, then build and import (every other stage needs the extension), then the rest in the order named
# on the command line, so that a short hold runs first what matters most to it.
ORDER=()
for s in env build import; do wants "$s" && ORDER+=("$s"); done
wants build && ! wants import && ORDER+=(import)
for s in "${STAGES[@]}"; do
  [[ $s == cudatests ]] && wants tests && continue  # tests runs the CUDA twins first anyway
  [[ " env build import " == *" $s "* || " ${ORDER[*]} " == *" $s "* ]] || ORDER+=("$s")
done
if [[ -n ${DRY_RUN:-} ]]; then  # DRY_RUN=1: say which stages would run, in order, and run none
  echo "stages in order: ${ORDER[*]}"
  exit 0
fi
# section FILE TITLE...: a benchmark's table under its title in the summary, when the benchmark wrote one.
section() {
  local file=$LOGS/$1
  shift
  [[ -s $file ]] || return 0
  printf '\n## %s\n\n' "$*"
  cat "$file"
}

# summary.md (the stages so far, the benchmarks' tables) and logs.tgz under $OUT: after every stage and at the end.
finish() {
  [[ -n ${TORCH_VERSION:-} ]] || TORCH_VERSION=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?')
  {
    echo "# pyengine GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
    echo "torch: $TORCH_VERSION"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo
    echo "| stage | status | seconds | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "stages run: ${STAGES[*]}"
    echo
    section bench_cuda.md "CUDA benchmark (ours vs stock; GB/s by single-pass bytes; copy = device dst.copy_(src))"
    section kernel_ab.md "The update kernel's block shape (bench/cuda_kernel_ab.py; of copy: GB/s by single-pass" \
      "bytes / copy GB/s)"
    section transfer.md "Gradient transfer and engine on the GPU"
    section arena.md "The host arena's pages: the host update and D2H copies (bench/bench_arena.py)"
    section pipeline.md "Pipeline stages as workers on one GPU"
  } >"$SUMMARY"
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
}

trap on_signal TERM INT
for s in "${ORDER[@]}"; do run_stage "$s"; done
# The built extension comes back too, so that a later call on a fresh machine can use it instead of building again.
wants build && cp pyengine/_C*.so "$OUT/" 2>/dev/null
finish
cat "$SUMMARY"
! grep -q FAILED "$SUMMARY"
