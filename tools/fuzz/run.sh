#!/usr/bin/env bash
# Builds the GGUF fuzzer (clang, libFuzzer + address + undefined sanitizers) from the model
# loader's sources and runs it for a fixed time from a generated seed corpus. A crash, a
# sanitizer report, a leak or a timeout makes this script fail and leaves the input in
# build/fuzz/ (crash-*, leak-*, timeout-*).
#
# Usage: tools/fuzz/run.sh [SECONDS]   (default 60)
# Needs clang and libclang-rt-dev (scripts/setup.sh installs both).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SECONDS_TO_RUN="${1:-60}"
OUT="${ROOT}/build/fuzz"
CXX="${FUZZ_CXX:-clang++}"
mkdir -p "${OUT}/corpus"

SOURCES=(
  "${ROOT}/tools/fuzz/gguf_fuzzer.cpp"
  "${ROOT}"/src/core/*.cpp
  "${ROOT}/src/model/gguf.cpp" "${ROOT}/src/model/quant.cpp" "${ROOT}/src/model/model_weights_gguf.cpp" "${ROOT}/src/model/model_weights_llama2c.cpp"
  "${ROOT}/src/model/tokenizer.cpp" "${ROOT}/src/model/tokenizer_bpe.cpp" "${ROOT}/src/model/tokenizer_spm.cpp"
  "${ROOT}/src/model/unicode.cpp"
  "${ROOT}/src/model/weight_matrix.cpp" "${ROOT}/src/kernels/ref/gemv.cpp" "${ROOT}/src/kernels/cpu/gemv.cpp"
)
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -I"${ROOT}/include" -I"${ROOT}/src")

echo "fuzz: building ${OUT}/gguf_fuzzer"
"${CXX}" "${FLAGS[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined "${SOURCES[@]}" \
  -lfmt -lhwy -lblas -lpthread -o "${OUT}/gguf_fuzzer"
"${CXX}" -std=c++20 -O1 -I"${ROOT}/include" "${ROOT}/tools/fuzz/make_seeds.cpp" -o "${OUT}/make_seeds"
"${OUT}/make_seeds" "${OUT}/corpus"

echo "fuzz: running for ${SECONDS_TO_RUN} s"
cd "${OUT}"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./gguf_fuzzer -max_total_time="${SECONDS_TO_RUN}" \
  -rss_limit_mb=2048 -timeout=10 -max_len=1048576 -print_final_stats=1 corpus 2>&1 | tail -n 25
status=${PIPESTATUS[0]}
if [ "${status}" -ne 0 ]; then
  echo "fuzz: FAILED (exit ${status}); reproducer in ${OUT}" >&2
  exit "${status}"
fi
echo "fuzz: no crash in ${SECONDS_TO_RUN} s"
