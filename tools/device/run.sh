#!/usr/bin/env bash
# One device run of the CUDA backend (docs/cuda.md): build, CUDA tests against the CPU
# float64 references, our GPU decode benchmark (synthetic workload + real traces), a
# per-kernel Nsight Compute breakdown of one sparse step, PyTorch's SDPA backends on the
# same GPU, then the joined short table printed last. Everything fits one device call
# (each stage has its own time limit; the stages together stay under ~9 minutes).
#
# Build: when build-device/ holds prebuilt binaries (cumulus_cuda_tests, cuda_decode_bench
# and their shared libraries in build-device/lib, made by tools/device/prebuild.sh on a
# machine with the Debian dependencies), they are used as they are; otherwise the project
# is configured with CUMULUS_CUDA=ON and built with -j16 (this needs the dependencies of
# scripts/setup.sh on the machine). Traces: every traces/*.bin.
#
# Files in $OUT (at most 8 come back from the device): summary.txt (the table), the two
# JSON reports, ncu.csv (per-kernel times), logs.tgz (gpu.txt, tests.log, bench.log,
# torch.log, ncu logs) and, with PROFILE=1, ncu_dense.txt (Nsight Compute sections of our
# dense kernel at 128K batch 1) and ncu_torch.txt (launch shape and time of PyTorch's
# cuDNN kernels on the same problem).
#
# Usage (on the device machine, from the repository root):
#   [PROFILE=1] [PROFILE_TORCH=1] [DENSE_PLANS=tc4,tc8,...] [METHODS=tactic,psa,...] [BASE=dir]
#   tools/device/run.sh [--quick]
# BASE: a second prebuilt benchmark (e.g. the main branch's) run first on 128K only, so one
# device run holds before and after figures.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$(mktemp -d)
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
t_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t_start )) s] $*"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1
  nproc
  (. /etc/os-release && echo "$PRETTY_NAME")
} > "$LOG/gpu.txt" 2>&1
cat "$LOG/gpu.txt"

if [ -x build-device/cumulus_cuda_tests ] && [ -x build-device/cuda_decode_bench ]; then
  BIN=$PWD/build-device
  # prebuild.sh packs the shared libraries; cuBLAS is the image's own.
  [ -f "$BIN/lib.tar.xz" ] && [ ! -d "$BIN/lib" ] && tar xJf "$BIN/lib.tar.xz" -C "$BIN"
  export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "using prebuilt binaries in build-device/"
else
  BIN=$PWD/build/cuda
  echo "building with CUMULUS_CUDA=ON"
  cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUMULUS_CUDA=ON -DCUMULUS_WERROR=OFF \
    > "$LOG/build.log" 2>&1 &&
    cmake --build build/cuda -j16 --target cumulus_cuda_tests cuda_decode_bench >> "$LOG/build.log" 2>&1
  rc=$?
  tail -20 "$LOG/build.log"
  if [ $rc -ne 0 ]; then echo "build failed (rc=$rc)"; exit $rc; fi
fi
pack() { tar -C "$LOG" -czf "$OUT/logs.tgz" . 2>/dev/null; }
trap pack EXIT

plans=()
[ -n "${DENSE_PLANS:-}" ] && plans=(--dense-plans "$DENSE_PLANS")
[ -n "${METHODS:-}" ] && plans+=(--methods "$METHODS")

if [ -n "${BASE:-}" ] && [ -x "$BASE/cuda_decode_bench" ] && [ $QUICK = 0 ]; then
  stamp "== baseline benchmark ($BASE, 128K)"
  LD_LIBRARY_PATH="$BASE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 150 "$BASE/cuda_decode_bench" \
    --contexts 131072 --batches 1,16 --methods tactic,psa --json "$OUT/base_bench.json" > "$LOG/base_bench.log" 2>&1
  echo "baseline bench rc=$?"
  grep -E "copy|batch" "$LOG/base_bench.log" | tail -20
fi

if command -v cuobjdump > /dev/null; then  # registers, shared memory and stack of our kernels
  cuobjdump --dump-resource-usage "$BIN/cuda_decode_bench" 2>/dev/null | sed -E "s/(Function [^:]+):/\1 :/" |
    c++filt > "$LOG/resources.txt"
  grep -A1 -E "Function .*(attention_|tactic_|centroid_score)" "$LOG/resources.txt" | grep -E "REG|Function" |
    paste - - | sed -E 's/ +/ /g' | cut -c1-170 | head -16
fi

stamp "== CUDA tests"
timeout 90 "$BIN/cumulus_cuda_tests" --gtest_color=no > "$LOG/tests.log" 2>&1
test_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|error|GPU vs CPU" "$LOG/tests.log" | head -40
echo "tests rc=$test_rc"

stamp "== GPU decode benchmark"
traces=()
for t in traces/*.bin; do [ -f "$t" ] && traces+=(--trace "$t"); done
if [ $QUICK = 1 ]; then
  bench_args=(--contexts 8192 --batches 1 --iters 5 --warmup 1)
  torch_args=(--contexts 8192 --batches 1 --iters 5 --warmup 1)
else
  bench_args=()
  torch_args=()
fi
timeout 230 "$BIN/cuda_decode_bench" "${bench_args[@]}" "${plans[@]}" "${traces[@]}" \
  --json "$OUT/cuda_decode_bench.json" > "$LOG/bench.log" 2>&1
echo "bench rc=$?"
grep -vE "^  batch .* dense " "$LOG/bench.log" | tail -30

NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ $QUICK = 0 ] && [ -x "$NCU" ]; then
  stamp "== per-kernel breakdown (Nsight Compute, 128K batch 1: one step of each method)"
  timeout 100 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    --log-file "$OUT/ncu.csv" \
    -k 'regex:attention_|centroid_score_step|sort_rows|tactic_|psa_|page_score|bitmap_|topk|top_mass|token_score|softmax|mark' \
    "$BIN/cuda_decode_bench" --contexts 131072 --batches 1 --iters 1 --warmup 0 --methods tactic,psa,quest \
    --dense-plans tc8 --json /tmp/ncu_bench.json > "$LOG/ncu_bench.log" 2>&1
  echo "ncu rc=$?"
  python3 tools/device/ncu_summary.py "$OUT/ncu.csv" 2>&1 | head -30
  if [ "${PROFILE:-0}" = 1 ]; then
    stamp "== Nsight Compute sections of the dense kernel (128K batch 1)"
    timeout 60 "$NCU" --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
      -k regex:attention_ --launch-count 6 \
      "$BIN/cuda_decode_bench" --contexts 131072 --batches 1 --iters 1 --warmup 0 --methods "" \
      --dense-plans "${PROFILE_PLANS:-tc8,tc4,simt8}" --json /tmp/ncu_dense.json > "$OUT/ncu_dense.txt" 2>&1
    echo "ncu dense rc=$?"
    grep -E "==PROF==|attention_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Stall|Issued Warp" \
      "$OUT/ncu_dense.txt" | head -40
  fi
else
  echo "ncu not run"
fi

stamp "== PyTorch SDPA"
PYTHONUNBUFFERED=1 timeout 90 python3 tools/device/torch_sdpa_bench.py "${torch_args[@]}" --json "$OUT/torch_sdpa.json" \
  > "$LOG/torch.log" 2>&1
echo "torch rc=$?"
tail -16 "$LOG/torch.log"
if [ "${PROFILE_TORCH:-0}" = 1 ] && [ $QUICK = 0 ] && [ -x "$NCU" ]; then
  stamp "== Nsight Compute: PyTorch cuDNN at 128K batch 1"
  PYTHONUNBUFFERED=1 timeout 45 "$NCU" --clock-control none --section LaunchStats --section SpeedOfLight \
    --section Occupancy python3 tools/device/torch_sdpa_bench.py --contexts 131072 --batches 1 --iters 1 --warmup 0 \
    --backends cudnn --json /tmp/torch_ncu.json > "$OUT/ncu_torch.txt" 2>&1
  echo "ncu torch rc=$?"
  grep -E "^  [a-zA-Z_].*\(|Duration|Grid Size|Block Size|Registers Per|Dynamic Shared|DRAM Throughput" \
    "$OUT/ncu_torch.txt" | grep -v -E "fill|elementwise|copy" | head -30
fi

stamp "== summary"
args=("$OUT/cuda_decode_bench.json" "$OUT/torch_sdpa.json")
[ -f "$OUT/base_bench.json" ] && args+=(--base "$OUT/base_bench.json")
python3 tools/device/summary.py "${args[@]}" 2>&1 | tee "$OUT/summary.txt"
