#!/usr/bin/env bash
# One device run of the GPU model runtime and the engine's own GPU commands (docs/cuda.md
# "Model runtime", "cumulus bench --device cuda"), from prebuilt binaries
# (`EXTRA_TARGETS=cuda_model_bench tools/device/prebuild.sh`, staged as build-device/; its
# programs may also come packed as build-device/bins.tar.xz to fit a device call): every
# CUDA test, `cumulus bench --device cuda` at 32K and 128K (every GPU method, then
# sketch_topp with its step cost rule off), `cuda_model_bench` (a 32K prefill against
# cuBLAS's GEMM rate, then decode with dense, sketch_topp, tactic sinks=4 and quest at 32K
# and 128K), and `cuda_decode_bench` at 128K with the dense plans tc8 and tc8/s1.
#
# The model tests read stories260K from CUMULUS_SHARED_DIR as the test binary was built
# (../shared beside the checkout that built it); STORIES=dir links that path to a carried
# copy when the device tree has none.
#
# Files in $OUT: tests.log, bench_cuda_*.json, model_bench.{log,json}, decode_bench.{log,json}.
# Usage (on the device machine, from the repository root):
#   [BIN=build-device] [STORIES=dir] [SHARED=/work/shared] tools/device/run_runtime.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
B=${BIN:-$PWD/build-device}
[ -f "$B/bins.tar.xz" ] && [ ! -x "$B/cumulus_cuda_tests" ] && tar xJf "$B/bins.tar.xz" -C "$B"
[ -f "$B/lib.tar.xz" ] && [ ! -d "$B/lib" ] && tar xJf "$B/lib.tar.xz" -C "$B"
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -n "${STORIES:-}" ]; then
  SHARED=${SHARED:-/work/shared}
  mkdir -p "$SHARED/data/models" /work/main && ln -sfn "$(cd "$STORIES" && pwd)" "$SHARED/data/models/stories260K"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 330 "$B/cumulus_cuda_tests" --gtest_color=no > "$OUT/tests.log" 2>&1
echo "tests rc $?"
grep -E "^\[ *(FAILED|PASSED|SKIPPED) *\]|Failure|Expected|Which is|actual" "$OUT/tests.log" | head -40
grep -E "model \]" "$OUT/tests.log" | head -40
for ctx in 32768 131072; do
  timeout 120 "$B/cumulus" bench --device cuda --context $ctx --threads "$(nproc)" --steps 8 --repeats 5 \
    --json "$OUT/bench_cuda_$ctx.json" 2>&1 | grep -E "^(dense|sketch_topp|tactic|psa|quest|oracle_topp|device|memory) "
  timeout 60 "$B/cumulus" bench --device cuda --context $ctx --threads "$(nproc)" --steps 8 --repeats 5 \
    --methods dense,sketch_topp --param sketch_topp.gpu_dense_mib=0 --json "$OUT/bench_cuda_sk0_$ctx.json" 2>&1 |
    grep -E "^(dense|sketch_topp) "
done
timeout 150 "$B/cuda_model_bench" --contexts 32768,131072 --batches 1 --steps 10 \
  --methods dense,sketch_topp,tactic:sinks=4,quest --json "$OUT/model_bench.json" > "$OUT/model_bench.log" 2>&1
echo "model bench rc $?"
grep -v "^$" "$OUT/model_bench.log"
timeout 60 "$B/cuda_decode_bench" --contexts 131072 --batches 1 --methods sketch_topp,tactic --dense-plans tc8,tc8/s1 \
  --json "$OUT/decode_bench.json" > "$OUT/decode_bench.log" 2>&1
echo "decode bench rc $?"
grep -vE "^\s*$" "$OUT/decode_bench.log" | tail -14
