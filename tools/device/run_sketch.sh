#!/usr/bin/env bash
# One device run of sketch_topp on the GPU (docs/cuda.md "sketch_topp on the GPU"), from
# prebuilt binaries (tools/device/prebuild.sh, staged as build-device/): the CUDA decode
# tests (sketch_topp's twin tests first), the decode benchmark with our dense kernel,
# sketch_topp and tactic on the synthetic workload (8K/32K/128K, batches 1, 4, 16) and on
# every traces/*.bin, PyTorch's cuDNN and flash on the same shapes in the same run, then
# the joined table printed last (summary.py).
#
# Files in $OUT: summary.txt, cuda_decode_bench.json, torch_sdpa.json, torch_smollm2.json, logs.tgz (gpu.txt,
# tests.log, bench.log, torch.log, resources.txt).
#
# Usage (on the device machine, from a tree holding build-device/ and traces/):
#   [CONTEXTS=8192,32768,131072] [BATCHES=1,4,16] [METHODS=sketch_topp,tactic] [TESTS=filter]
#   [BENCH_ARGS=...] tools/device/run_sketch.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$(mktemp -d)
t_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t_start )) s] $*"; }
pack() { tar -C "$LOG" -czf "$OUT/logs.tgz" . 2>/dev/null; }
trap pack EXIT

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv 2>&1
} > "$LOG/gpu.txt" 2>&1
cat "$LOG/gpu.txt"

BIN=$PWD/build-device
[ -f "$BIN/lib.tar.xz" ] && [ ! -d "$BIN/lib" ] && tar xJf "$BIN/lib.tar.xz" -C "$BIN"
export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

if command -v cuobjdump > /dev/null; then  # registers, shared memory and spills of the sketch kernels
  cuobjdump --dump-resource-usage "$BIN/cuda_decode_bench" 2>/dev/null | c++filt > "$LOG/resources.txt"
  grep -A1 -E "Function .*sketch_" "$LOG/resources.txt" | grep -E "REG|Function" | paste - - |
    sed -E 's/ +/ /g' | grep -E "sm_90|<4|sketch_(hist|marks|claims|channels|encode)" | cut -c1-200 | head -12
fi

stamp "== CUDA tests"
timeout "${TEST_TIMEOUT:-120}" "$BIN/cumulus_cuda_tests" --gtest_color=no \
  --gtest_filter="${TESTS:-CudaSketchTopp.*:CudaMethods.*}" > "$LOG/tests.log" 2>&1
echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure|error|GPU vs CPU|sketch_topp" "$LOG/tests.log" | head -60

stamp "== GPU decode benchmark"
traces=()
for t in traces/*.bin; do [ -f "$t" ] && traces+=(--trace "$t"); done
timeout "${BENCH_TIMEOUT:-280}" "$BIN/cuda_decode_bench" --contexts "${CONTEXTS:-8192,32768,131072}" \
  --batches "${BATCHES:-1,4,16}" --methods "${METHODS:-sketch_topp,tactic}" ${BENCH_ARGS:-} "${traces[@]}" \
  --json "$OUT/cuda_decode_bench.json" > "$LOG/bench.log" 2>&1
echo "bench rc=$?"
grep -vE "^  (batch .* dense |layer .* dense )" "$LOG/bench.log" | tail -60

stamp "== PyTorch SDPA"
PYTHONUNBUFFERED=1 timeout "${TORCH_TIMEOUT:-90}" python3 tools/device/torch_sdpa_bench.py \
  --contexts "${CONTEXTS:-8192,32768,131072}" --batches "${BATCHES:-1,4,16}" --backends cudnn,flash \
  --json "$OUT/torch_sdpa.json" > "$LOG/torch.log" 2>&1
echo "torch rc=$?"
tail -12 "$LOG/torch.log"
if [ -f traces/smollm2_8k_l3_15_27.bin ]; then  # the SmolLM2 trace's shape: 9 query / 3 kv heads, d 64, last step
  PYTHONUNBUFFERED=1 timeout 40 python3 tools/device/torch_sdpa_bench.py --shape 9,3,64 --contexts 8016 --batches 1 \
    --backends cudnn,flash --json "$OUT/torch_smollm2.json" > "$LOG/torch_smollm2.log" 2>&1
  echo "torch (SmolLM2 trace shape) rc=$?"
  tail -4 "$LOG/torch_smollm2.log"
fi

stamp "== summary"
python3 tools/device/summary.py "$OUT/cuda_decode_bench.json" "$OUT/torch_sdpa.json" 2>&1 | tee "$OUT/summary.txt"
