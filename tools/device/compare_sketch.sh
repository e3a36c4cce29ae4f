#!/usr/bin/env bash
# sketch_topp's GPU step, this build against a base build, in one device call (docs/cuda.md,
# "The selection passes on the tensor cores"): the CUDA tests of build-device (TESTS, a
# gtest filter; default all), then `cuda_decode_bench --methods sketch_topp,sketch_topp_d0=sketch_topp
# --param sketch_topp_d0.gpu_dense_mib=0 --dense-plans tc8` (sketch_topp_d0: sketch_topp without
# the step-cost rule) of the base build (BASE: a directory holding its cuda_decode_bench, e.g.
# the main branch's, staged by tools/device/prebuild.sh) and of build-device, alternated
# twice; a base built before cuda_decode_bench took --param and LABEL=NAME (it refuses
# --param) runs `--methods sketch_topp,sketch_topp_d0`, its built-in name for the same method; PyTorch's cuDNN and flash on the same shapes (tools/device/torch_sdpa_bench.py);
# with TRACE (a `cumulus trace` file) the methods on that trace and PyTorch on its shape
# (TRACE_SHAPE, e.g. 9,3,64, and TRACE_CONTEXT, e.g. 8016); with NCU=1 Nsight Compute's
# instruction and DRAM counts of the weights pass at 128K, batches 16 and 1. Every program
# times the same way (a CUDA graph, a 256 MiB L2 flush before each replay, the median of
# 30) and measures the copy bandwidth in its own process.
#
# Files in $OUT: compare.log (everything printed), tests.log, runs.tgz (the benchmarks'
# logs and JSON; at most 8 files come back from a device call).
# Usage (on the device machine, from the tree holding build-device/ and BASE):
#   BASE=dir [CONTEXTS=8192,32768,131072] [BATCHES=1,4,16] [TESTS=filter] [TRACE=file
#   TRACE_SHAPE=q,kv,d TRACE_CONTEXT=n] [NCU=1] tools/device/compare_sketch.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${BASE:?BASE must name a directory holding a base cuda_decode_bench}"
[ -x "$BASE/cuda_decode_bench" ] || { echo "compare_sketch.sh: no executable $BASE/cuda_decode_bench" >&2; exit 2; }
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
RUNS=$(mktemp -d)
exec > >(tee "$OUT/compare.log") 2>&1
BIN=$PWD/build-device
[ -f "$BIN/lib.tar.xz" ] && [ ! -d "$BIN/lib" ] && tar xJf "$BIN/lib.tar.xz" -C "$BIN"
export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
CONTEXTS=${CONTEXTS:-8192,32768,131072}
BATCHES=${BATCHES:-1,4,16}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.mem --format=csv,noheader

# Sets M (the --methods list) and P (the --param words) for the cuda_decode_bench $1. The probe
# ends in argument checks, before any device work: a build without --param says "unknown
# option '--param'", a build with it refuses --iters 0.
sketch_methods() {
  if timeout 30 "$1" --param sketch_topp_d0.gpu_dense_mib=0 --iters 0 2>&1 | grep -q "unknown option '--param'"; then
    M=sketch_topp,sketch_topp_d0
    P=()
  else
    M=sketch_topp,sketch_topp_d0=sketch_topp
    P=(--param sketch_topp_d0.gpu_dense_mib=0)
  fi
}

timeout 300 "$BIN/cumulus_cuda_tests" --gtest_color=no --gtest_filter="${TESTS:-*}" > "$OUT/tests.log" 2>&1
echo "tests rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/tests.log" | head -20

for i in 1 2; do
  for b in base new; do
    exe="$BIN/cuda_decode_bench"
    [ "$b" = base ] && exe="$BASE/cuda_decode_bench"
    sketch_methods "$exe"
    timeout 200 "$exe" --contexts "$CONTEXTS" --batches "$BATCHES" --methods "$M" ${P[@]+"${P[@]}"} \
      --dense-plans tc8 --json "$RUNS/$b.$i.json" > "$RUNS/$b.$i.log" 2>&1
    echo "== $b round $i rc $? (--methods $M ${P[*]})"
    grep -E "copy:|^context|dense tc8|step|phases" "$RUNS/$b.$i.log" | sed -E 's/ +/ /g'
  done
done

PYTHONUNBUFFERED=1 timeout 120 python3 tools/device/torch_sdpa_bench.py --contexts "$CONTEXTS" --batches "$BATCHES" \
  --backends cudnn,flash --json "$RUNS/torch.json" > "$RUNS/torch.log" 2>&1
echo "== torch rc $?"
grep -E "copy|n=" "$RUNS/torch.log"

if [ -n "${TRACE:-}" ]; then
  timeout 150 "$BIN/cuda_decode_bench" --contexts "" --batches 1 --methods sketch_topp,sketch_topp_d0=sketch_topp,tactic --param sketch_topp_d0.gpu_dense_mib=0 \
    --trace "$TRACE" --json "$RUNS/trace.json" > "$RUNS/trace.log" 2>&1
  echo "== trace rc $?"
  grep -vE "^  layer .* dense " "$RUNS/trace.log" | tail -16
  PYTHONUNBUFFERED=1 timeout 60 python3 tools/device/torch_sdpa_bench.py --shape "$TRACE_SHAPE" \
    --contexts "$TRACE_CONTEXT" --batches 1 --backends cudnn,flash --json "$RUNS/torch_trace.json" \
    > "$RUNS/torch_trace.log" 2>&1
  echo "== torch (trace shape) rc $?"
  grep -E "n=" "$RUNS/torch_trace.log"
fi

if [ "${NCU:-0}" = 1 ]; then
  NCU_BIN=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  M=gpu__time_duration.sum,smsp__inst_executed.sum,dram__bytes_read.sum,dram__bytes_write.sum
  M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread
  for b in 16 1; do
    timeout 90 "$NCU_BIN" --clock-control none --metrics "$M" -k regex:sketch_weights --launch-count 1 \
      "$BIN/cuda_decode_bench" --contexts 131072 --batches $b --iters 1 --warmup 0 --methods sketch_topp_d0=sketch_topp --param sketch_topp_d0.gpu_dense_mib=0 \
      --dense-plans "" --json /tmp/ncu.json > "$RUNS/ncu_weights_b$b.txt" 2>&1
    echo "== ncu, weights pass, 128K batch $b rc $?"
    grep -E "__" "$RUNS/ncu_weights_b$b.txt" | awk '{print $1, $(NF-1), $NF}'
  done
fi
tar -C "$RUNS" -czf "$OUT/runs.tgz" .
