#!/usr/bin/env bash
# Builds the fuzzers (clang, libFuzzer + address + undefined sanitizers) from the parsers'
# sources and runs each for a fixed time from a generated seed corpus:
#   gguf               GGUF reader, llama config and weight loader, tokenizer from metadata
#   gguf_tokenizer     tokenizer from GGUF metadata alone, encode/decode of fuzzed text
#   llama2c            llama2.c .bin detection and loader
#   llama2c_tokenizer  llama2.c tok*.bin reader, encode/decode
#   tokenizer_text     SmolLM2's and tok512's tokenizers on up to 256 KiB of fuzzed text
#                      (encode, encode_prefix): their running time
#   trace              `cumulus trace` file reader (sizes against the file) and its cache
#   kv_snapshot        KV snapshot reader (--kv-load; sizes, checksum, values) and restore
# A crash, a sanitizer report, a leak, a timeout or memory past -rss_limit_mb makes this
# script fail and leaves the input in build/fuzz/NAME/ (crash-*, leak-*, timeout-*, oom-*).
# The time limit per input (-timeout, wall clock) is FUZZ_TIMEOUT seconds (default 10) for
# the file parsers and FUZZ_TOKENIZER_TIMEOUT (default 8) for the tokenizer fuzzers, so that
# text which tokenizes slowly fails the run as a crash does: tokenizer_text's 256 KiB take
# about 1 s of CPU with the sanitizers (3-5 s of wall clock on a loaded 2-core machine, the
# first input also loading the vocabularies), a merge quadratic in a word's length minutes.
#
# Usage: tools/fuzz/run.sh [SECONDS_EACH] [NAME...]   (default 40 s each, every fuzzer)
# Needs clang and libclang-rt-dev (scripts/setup.sh installs both).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SECONDS_EACH="${1:-40}"
shift || true
NAMES=("$@")
[ "${#NAMES[@]}" -gt 0 ] || NAMES=(gguf gguf_tokenizer llama2c llama2c_tokenizer tokenizer_text trace kv_snapshot)
OUT="${ROOT}/build/fuzz"
CXX="${FUZZ_CXX:-clang++}"
JOBS="${FUZZ_JOBS:-2}"
mkdir -p "${OUT}/obj"

# Library sources every fuzzer links (compiled once, to objects, with the sanitizers).
LIB_SOURCES=(
  "${ROOT}"/src/core/*.cpp
  "${ROOT}/src/model/gguf.cpp" "${ROOT}/src/model/quant.cpp" "${ROOT}/src/model/model_weights_gguf.cpp"
  "${ROOT}/src/model/model_weights_llama2c.cpp"
  "${ROOT}/src/model/tokenizer.cpp" "${ROOT}/src/model/tokenizer_bpe.cpp" "${ROOT}/src/model/tokenizer_spm.cpp"
  "${ROOT}/src/model/unicode.cpp"
  "${ROOT}/src/model/weight_matrix.cpp" "${ROOT}/src/kernels/ref/gemv.cpp" "${ROOT}/src/kernels/cpu/gemv.cpp"
  "${ROOT}/src/kv/kv_cache.cpp" "${ROOT}/src/kv/kv_snapshot.cpp" "${ROOT}/src/eval/trace.cpp"
)
FLAGS=(-std=c++20 -O1 -g -fno-omit-frame-pointer -I"${ROOT}/include" -I"${ROOT}/src"
       -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined)

echo "fuzz: compiling ${#LIB_SOURCES[@]} library sources (${JOBS} jobs)"
export CXX ROOT OUT
export FLAGS_STR="${FLAGS[*]}"
printf '%s\n' "${LIB_SOURCES[@]}" | xargs -P "${JOBS}" -I{} bash -c '
  src="{}"; obj="${OUT}/obj/$(echo "${src#${ROOT}/}" | tr / _).o"
  # Rebuild when the source or any project header is newer than the object.
  if [ ! -f "${obj}" ] || [ "${src}" -nt "${obj}" ] || \
     [ -n "$(find "${ROOT}/include" "${ROOT}/src" -name "*.h" -newer "${obj}" -print -quit)" ]; then
    ${CXX} ${FLAGS_STR} -c "${src}" -o "${obj}"
  fi'
OBJS=()
for src in "${LIB_SOURCES[@]}"; do OBJS+=("${OUT}/obj/$(echo "${src#${ROOT}/}" | tr / _).o"); done

"${CXX}" -std=c++20 -O1 -I"${ROOT}/include" "${ROOT}/tools/fuzz/make_seeds.cpp" -o "${OUT}/make_seeds"

failed=()
for name in "${NAMES[@]}"; do
  echo "fuzz: building ${name}_fuzzer"
  "${CXX}" "${FLAGS[@]}" -DCUMULUS_SHARED_DIR="\"${ROOT}/../shared\"" -fsanitize=fuzzer \
    "${ROOT}/tools/fuzz/${name}_fuzzer.cpp" "${OBJS[@]}" \
    -lfmt -lhwy -lblas -lpthread -o "${OUT}/${name}_fuzzer"
  mkdir -p "${OUT}/${name}/corpus"
  "${OUT}/make_seeds" "${name}" "${OUT}/${name}/corpus"
  case "${name}" in
    *tokenizer*) timeout_s="${FUZZ_TOKENIZER_TIMEOUT:-8}" ;;
    *) timeout_s="${FUZZ_TIMEOUT:-10}" ;;
  esac
  echo "fuzz: running ${name}_fuzzer for ${SECONDS_EACH} s (at most ${timeout_s} s an input)"
  set +e
  (cd "${OUT}/${name}" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
     "${OUT}/${name}_fuzzer" -max_total_time="${SECONDS_EACH}" -rss_limit_mb=2048 -malloc_limit_mb=1024 \
     -timeout="${timeout_s}" -max_len=1048576 -print_final_stats=1 corpus 2>&1 | tail -n 12; exit "${PIPESTATUS[0]}")
  status=$?
  set -e
  if [ "${status}" -ne 0 ]; then
    echo "fuzz: ${name} FAILED (exit ${status}); reproducer in ${OUT}/${name}" >&2
    failed+=("${name}")
  fi
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: ${#NAMES[@]} fuzzers, ${SECONDS_EACH} s each, no crash"
