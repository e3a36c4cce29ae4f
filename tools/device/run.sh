#!/usr/bin/env bash
# One device run of the CUDA backend (docs/cuda.md): build, CUDA tests against the CPU
# float64 references, our GPU decode benchmark (synthetic workload + real traces), PyTorch's
# SDPA backends on the same GPU, then the joined short table printed last. Logs and JSON go
# to $OUT (at most 8 files come back from the device).
#
# Build: when build-device/ holds prebuilt binaries (cumulus_cuda_tests, cuda_decode_bench
# and their shared libraries in build-device/lib, made by tools/device/prebuild.sh on a
# machine with the Debian dependencies), they are used as they are; otherwise the project
# is configured with CUMULUS_CUDA=ON and built with -j16 (this needs the dependencies of
# scripts/setup.sh on the machine). Traces: every traces/*.bin.
#
# Usage (on the device machine, from the repository root): tools/device/run.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1
  nproc
  (. /etc/os-release && echo "$PRETTY_NAME")
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

if [ -x build-device/cumulus_cuda_tests ] && [ -x build-device/cuda_decode_bench ]; then
  BIN=$PWD/build-device
  export LD_LIBRARY_PATH="$PWD/build-device/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "using prebuilt binaries in build-device/"
else
  BIN=$PWD/build/cuda
  echo "building with CUMULUS_CUDA=ON"
  cmake -S . -B build/cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DCUMULUS_CUDA=ON -DCUMULUS_WERROR=OFF \
    > "$OUT/build.log" 2>&1 &&
    cmake --build build/cuda -j16 --target cumulus_cuda_tests cuda_decode_bench >> "$OUT/build.log" 2>&1
  rc=$?
  tail -20 "$OUT/build.log"
  if [ $rc -ne 0 ]; then echo "build failed (rc=$rc)"; exit $rc; fi
fi

echo "== CUDA tests"
timeout 400 "$BIN/cumulus_cuda_tests" --gtest_color=no > "$OUT/tests.log" 2>&1
test_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|error|GPU vs CPU" "$OUT/tests.log" | head -60
echo "tests rc=$test_rc"

echo "== GPU decode benchmark"
traces=()
for t in traces/*.bin; do [ -f "$t" ] && traces+=(--trace "$t"); done
if [ $QUICK = 1 ]; then
  bench_args=(--contexts 8192 --batches 1 --iters 5 --warmup 1)
  torch_args=(--contexts 8192 --batches 1 --iters 5 --warmup 1)
else
  bench_args=()
  torch_args=()
fi
timeout 420 "$BIN/cuda_decode_bench" "${bench_args[@]}" "${traces[@]}" --json "$OUT/cuda_decode_bench.json" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
tail -40 "$OUT/bench.log"

echo "== per-kernel breakdown (Nsight Compute, 128K batch 1: one step of each method)"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ $QUICK = 0 ] && [ -x "$NCU" ]; then
  timeout 240 "$NCU" --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    --log-file "$OUT/ncu.csv" \
    -k 'regex:attention_|centroid_score_step|sort_rows|tactic_|psa_|page_score|bitmap_|topk|top_mass|token_score|softmax|mark' \
    "$BIN/cuda_decode_bench" --contexts 131072 --batches 1 --iters 1 --warmup 0 --methods tactic,psa,quest \
    --json /tmp/ncu_bench.json > /dev/null 2>&1
  echo "ncu rc=$?"
  python3 tools/device/ncu_summary.py "$OUT/ncu.csv" 2>&1 | head -40
else
  echo "ncu not run"
fi

echo "== PyTorch SDPA"
PYTHONUNBUFFERED=1 timeout 300 python3 tools/device/torch_sdpa_bench.py "${torch_args[@]}" --json "$OUT/torch_sdpa.json" \
  > "$OUT/torch.log" 2>&1
echo "torch rc=$?"
tail -25 "$OUT/torch.log"

echo "== summary"
python3 tools/device/summary.py "$OUT/cuda_decode_bench.json" "$OUT/torch_sdpa.json" 2>&1 | tee "$OUT/summary.txt"
