#!/usr/bin/env bash
# One device run of the CUDA prefill kernels (docs/cuda.md "Prefill"): the prefill CUDA tests
# against the CPU float64 references, our GPU prefill benchmark (dense and flexprefill,
# llama3-8b shape, then Gemma 3 270M's: 4/1 heads, head_dim 256), PyTorch's causal SDPA
# backends on the same GPU (llama3-8b shape), then the joined table printed last. Logs and
# JSON go to $OUT.
#
# Needs prebuilt binaries in build-device/, or in $BIN (tools/device/prebuild.sh builds
# cumulus_cuda_tests and cuda_prefill_bench with their shared libraries).
# Usage (on the device machine, from the repository root): tools/device/run_prefill.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
CONTEXTS=32768,131072
ITERS=5
[ "${1:-}" = "--quick" ] && CONTEXTS=8192 && ITERS=2
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$OUT/prefill_gpu.txt"
BIN=${BIN:-$PWD/build-device}
# prebuild.sh packs the shared libraries; cuBLAS is the image's own.
[ -f "$BIN/lib.tar.xz" ] && [ ! -d "$BIN/lib" ] && tar xJf "$BIN/lib.tar.xz" -C "$BIN"
export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

echo "== CUDA prefill tests"
timeout 300 "$BIN/cumulus_cuda_tests" --gtest_color=no --gtest_filter='CudaPrefill*' > "$OUT/prefill_tests.log" 2>&1
echo "tests rc=$?"
grep -E "^\[  (PASSED|FAILED|SKIPPED|       OK) |^\[==========\]|Failure|error|Expected|Which is|actual" "$OUT/prefill_tests.log" | head -60

echo "== GPU prefill benchmark"
timeout 400 "$BIN/cuda_prefill_bench" --contexts "$CONTEXTS" --iters "$ITERS" --json "$OUT/cuda_prefill_bench.json" \
  > "$OUT/prefill_bench.log" 2>&1
echo "bench rc=$?"
cat "$OUT/prefill_bench.log"

echo "== GPU prefill benchmark, Gemma 3 270M shape (4/1 heads, head_dim 256)"
timeout 300 "$BIN/cuda_prefill_bench" --shape gemma3-270m --contexts "$CONTEXTS" --iters "$ITERS" \
  --json "$OUT/cuda_prefill_bench_gemma3.json" > "$OUT/prefill_bench_gemma3.log" 2>&1
echo "bench rc=$?"
cat "$OUT/prefill_bench_gemma3.log"

echo "== PyTorch SDPA causal"
PYTHONUNBUFFERED=1 timeout 300 python3 tools/device/torch_prefill_bench.py --contexts "$CONTEXTS" --iters "$ITERS" \
  --json "$OUT/torch_prefill.json" --ours "$OUT/cuda_prefill_bench.json" > "$OUT/torch_prefill.log" 2>&1
echo "torch rc=$?"
cat "$OUT/torch_prefill.log"
