#!/usr/bin/env bash
# Builds the llama.cpp reference (never part of the cumulus build, never committed): the
# llama.cpp that the Python package llama-cpp-python vendors, from its source distribution.
# Only what the reference scripts need: libllama + ggml, llama-bench, and
# tools/reference/llamacpp_logits.cpp (top-k logits at chosen positions for given token ids).
#
# Output (git-ignored): ${CUMULUS_REFERENCE_DIR:-<repo>/.reference}/
#   llama-cpp-python-<version>/   unpacked sdist (llama.cpp in vendor/llama.cpp)
#   llamacpp-build/bin/llama-bench, llamacpp-build/bin/llamacpp_logits
# Idempotent: reruns only rebuild what changed. Two cores: -j2 (about 10-15 minutes cold).
#
# Usage: tools/reference/build_llamacpp.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${CUMULUS_REFERENCE_DIR:-${ROOT}/.reference}"
SRC="${DIR}/llama_cpp_python-${VERSION}"
LLAMA="${SRC}/vendor/llama.cpp"
BUILD="${DIR}/llamacpp-build"
JOBS="${JOBS:-2}"

mkdir -p "${DIR}"
if [[ ! -f "${LLAMA}/CMakeLists.txt" ]]; then
  echo "build_llamacpp: downloading the llama-cpp-python==${VERSION} source distribution"
  # --no-binary for this package only: with ":all:" pip also builds the sdist's build
  # dependencies (scikit-build-core, hatchling, ...) from source and stalls for minutes.
  python3 -m pip download --quiet --no-binary llama-cpp-python --no-deps --dest "${DIR}" "llama-cpp-python==${VERSION}"
  tar -xzf "${DIR}/llama_cpp_python-${VERSION}.tar.gz" -C "${DIR}"
fi
[[ -f "${LLAMA}/CMakeLists.txt" ]] || { echo "build_llamacpp: error: no vendor/llama.cpp in ${SRC}" >&2; exit 1; }

# A tiny CMake project: llama.cpp as a subdirectory (its own options), plus our logits tool.
WRAP="${DIR}/llamacpp-wrapper"
mkdir -p "${WRAP}"
cat > "${WRAP}/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(cumulus_llamacpp_reference C CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY \${CMAKE_BINARY_DIR}/bin)
add_subdirectory("${LLAMA}" llama.cpp)
add_executable(llamacpp_logits "${ROOT}/tools/reference/llamacpp_logits.cpp")
target_link_libraries(llamacpp_logits PRIVATE llama)
target_compile_features(llamacpp_logits PRIVATE cxx_std_17)
CMAKE

# Release, native CPU (AVX2 here), no network/HTTPS, no tests/examples/server/UI.
# ccache is used only when the caller set CMAKE_CXX_COMPILER_LAUNCHER.
cmake -S "${WRAP}" -B "${BUILD}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF | tail -n 3
cmake --build "${BUILD}" -j"${JOBS}" --target llama-bench llamacpp_logits
echo "build_llamacpp: ${BUILD}/bin/llama-bench and ${BUILD}/bin/llamacpp_logits (llama.cpp from llama-cpp-python ${VERSION})"
