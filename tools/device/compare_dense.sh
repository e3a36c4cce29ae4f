#!/usr/bin/env bash
# Dense decode attention on one GPU, four ways in one device call (docs/cuda.md, "Our dense
# kernel against cuDNN and FlashInfer"): our kernel as built (build-device/, from
# tools/device/prebuild.sh) and one or two base builds of it (BASE, BASE2: e.g. the main
# branch's cuda_decode_bench and an intermediate one), alternated twice; PyTorch's cuDNN and flash
# (tools/device/torch_sdpa_bench.py); FlashInfer's paged decode, both its kernels
# (flashinfer_decode_bench, built here by tools/device/build_flashinfer_bench.sh). Every
# program times the same way (a CUDA graph of the call, a 256 MiB L2 flush before each
# replay, the median of 30) and measures the copy bandwidth in its own process. Then the
# CUDA tests of build-device (TESTS, a gtest filter; default all) and, with METHODS (registry
# names, comma-separated, as every build's cuda_decode_bench --methods takes them), the sparse
# steps of every build (the sparse attention shares the kernel).
#
# Files in $OUT: compare.log (everything below), base_<i>.json, base2_<i>.json, new_<i>.json,
# torch.json, flashinfer.json, tests.log, sparse_<build>.json (at most 8 files come back from
# a device call: name fewer builds or rounds when all are wanted).
# Usage (on the device machine, from the tree holding build-device/ and BASE):
#   BASE=dir [BASE2=dir] [PLANS=tc8,tc8/k0] [CONTEXTS=8192,32768,131072] [BATCHES=1,4,16] [FLASHINFER=path]
#   [METHODS=sketch_topp,tactic] [TESTS=filter] tools/device/compare_dense.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/compare.log") 2>&1
t_start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t_start )) s] $*"; }
BIN=$PWD/build-device
[ -f "$BIN/lib.tar.xz" ] && [ ! -d "$BIN/lib" ] && tar xJf "$BIN/lib.tar.xz" -C "$BIN"
export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
CONTEXTS=${CONTEXTS:-8192,32768,131072}
BATCHES=${BATCHES:-1,4,16}
PLANS=${PLANS:-tc8,tc8/k0}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.mem --format=csv,noheader

dense() {  # label binary plans json
  timeout 150 "$2" --contexts "$CONTEXTS" --batches "$BATCHES" --methods "" --dense-plans "$3" --json "$4" \
    > /tmp/dense.log 2>&1
  echo "$1 rc $?"
  grep -E "copy:|^context|batch +[0-9]+: dense" /tmp/dense.log | sed "s/^/$1: /" | head -60
}
for i in 1 2; do
  [ -n "${BASE:-}" ] && { stamp "== base, round $i"; dense base "$BASE/cuda_decode_bench" tc8 "$OUT/base_$i.json"; }
  [ -n "${BASE2:-}" ] && { stamp "== base2, round $i"; dense base2 "$BASE2/cuda_decode_bench" tc8 "$OUT/base2_$i.json"; }
  stamp "== new, round $i"
  dense new "$BIN/cuda_decode_bench" "$PLANS" "$OUT/new_$i.json"
done

stamp "== PyTorch SDPA"
PYTHONUNBUFFERED=1 timeout 120 python3 tools/device/torch_sdpa_bench.py --contexts "$CONTEXTS" --batches "$BATCHES" \
  --backends cudnn,flash --json "$OUT/torch.json" > /tmp/torch.log 2>&1
echo "torch rc $?"
grep -E "copy|n=" /tmp/torch.log

FI=${FLASHINFER:-$PWD/build-device/flashinfer_decode_bench}
if [ -x "$FI" ]; then
  stamp "== FlashInfer"
  timeout 120 "$FI" --contexts "$CONTEXTS" --batches "$BATCHES" --json "$OUT/flashinfer.json"
  echo "flashinfer rc $?"
fi

if [ -n "${METHODS:-}" ]; then
  for b in base base2 new; do
    bin=$BIN/cuda_decode_bench
    [ $b = base ] && bin=${BASE:-}/cuda_decode_bench
    [ $b = base2 ] && bin=${BASE2:-}/cuda_decode_bench
    [ -x "$bin" ] || continue
    stamp "== sparse steps, $b"
    timeout 150 "$bin" --contexts "$CONTEXTS" --batches "$BATCHES" --methods "$METHODS" --dense-plans tc8 \
      --json "$OUT/sparse_$b.json" > /tmp/sparse.log 2>&1
    echo "sparse $b rc $?"
    grep -E "^context|batch +[0-9]+: [a-z_0-9]+ +(step|select)|attend timeline" /tmp/sparse.log | sed "s/^/$b: /" |
      head -60
  done
fi

stamp "== CUDA tests"
timeout "${TEST_TIMEOUT:-240}" "$BIN/cumulus_cuda_tests" --gtest_color=no --gtest_filter="${TESTS:-*}" \
  > "$OUT/tests.log" 2>&1
echo "tests rc $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|Failure" "$OUT/tests.log" | head -40
stamp "done"
