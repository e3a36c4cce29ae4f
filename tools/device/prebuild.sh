#!/usr/bin/env bash
# Builds the CUDA tests and GPU benchmarks here (nvcc and the Debian dependencies of
# scripts/setup.sh present, no GPU needed) and stages them for a device run: build/device/
# gets the three executables (tests, decode and prefill benchmarks) and build/device/lib the
# shared libraries they need that a bare CUDA image lacks (fmt, Highway; OpenBLAS is not linked: --as-needed drops it). Copy
# build/device to <device tree>/build-device; tools/device/run.sh then skips its build.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --preset cuda > /dev/null
cmake --build --preset cuda -j"${JOBS:-2}" --target cumulus_cuda_tests cuda_decode_bench cuda_prefill_bench
rm -rf build/device
mkdir -p build/device/lib
cp build/cuda/cumulus_cuda_tests build/cuda/cuda_decode_bench build/cuda/cuda_prefill_bench build/device/
for lib in $(ldd build/device/cumulus_cuda_tests build/device/cuda_decode_bench build/device/cuda_prefill_bench | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libfmt.so*|libhwy.so*) cp -L "$lib" build/device/lib/ ;;
  esac
done
ls -la build/device build/device/lib
