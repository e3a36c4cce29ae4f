#!/usr/bin/env bash
# One device call for the host tier (docs/cuda.md "Host tier"): the tier's CUDA tests, then
# cuda_tier_bench with the arguments given (see its usage in bench/cuda_tier_bench.cpp).
# Binaries come from build-device/ as tools/device/prebuild.sh stages them (xz-compressed
# ones, *.xz, are unpacked first), with their libraries in build-device/lib.tar.xz.
#
# Files in $OUT: tests.log, tier.log (the table), tier.json.
#
# Usage (on the device machine, from the repository root):
#   [TESTS=none] [TEST_FILTER='CudaKvTier*'] [TEST_TIMEOUT=120] [BENCH_TIMEOUT=480]
#   tools/device/run_tier.sh --contexts 1048576 --ratios 1,2,4
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
BIN=$(mktemp -d)
mkdir -p "$OUT"
cp build-device/* "$BIN"/
(cd "$BIN" && for f in *.xz; do case "$f" in lib.tar.xz) ;; *) unxz -f "$f" ;; esac; done &&
  tar xJf lib.tar.xz && chmod +x cumulus_cuda_tests cuda_tier_bench)
export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64"
if [ "${TESTS:-run}" != none ]; then
  timeout "${TEST_TIMEOUT:-120}" "$BIN/cumulus_cuda_tests" --gtest_color=no \
    --gtest_filter="${TEST_FILTER:-CudaKvTier*}" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|promote_reads" "$OUT/tests.log" | head -30
fi
free -g | head -2
timeout "${BENCH_TIMEOUT:-480}" "$BIN/cuda_tier_bench" "$@" --json "$OUT/tier.json" 2>&1 | tee "$OUT/tier.log"
echo "bench rc=${PIPESTATUS[0]}"
