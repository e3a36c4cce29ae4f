#!/usr/bin/env bash
# Builds the CUDA tests, GPU benchmarks and the CLI here (nvcc and the Debian dependencies of
# scripts/setup.sh present, no GPU needed) and stages them for a device run: build/device/
# gets the executables (tests, decode, prefill and host-tier benchmarks, `cumulus`) and build/device/lib
# the shared libraries they need that a bare CUDA image lacks (fmt, Highway, and OpenBLAS with
# its Fortran runtime: the CLI and the model tests run the CPU Session too), packed as
# build/device/lib.tar.xz. cuBLAS comes from the device image (/usr/local/cuda/lib64). Copy
# build/device to <device tree>/build-device; tools/device/run.sh then skips its build.
set -euo pipefail
cd "$(dirname "$0")/../.."
cmake --preset cuda > /dev/null
cmake --build --preset cuda -j"${JOBS:-2}" --target cumulus_cuda_tests cuda_decode_bench cuda_prefill_bench cuda_tier_bench cumulus_cli ${EXTRA_TARGETS:-}
rm -rf build/device
mkdir -p build/device/lib
bins="build/cuda/cumulus_cuda_tests build/cuda/cuda_decode_bench build/cuda/cuda_prefill_bench build/cuda/cuda_tier_bench build/cuda/cumulus"
for t in ${EXTRA_TARGETS:-}; do bins="$bins build/cuda/$t"; done
cp $bins build/device/
for lib in $(ldd $bins | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libfmt.so*|libhwy.so*|libopenblas*.so*|libgfortran.so*|libquadmath.so*) cp -L "$lib" build/device/lib/ ;;
  esac
done
# OpenBLAS alone is ~36 MB: strip the programs and pack lib/ (xz) so build/device stays well
# under the 64 MiB a device call carries; run.sh and run_prefill.sh unpack it.
strip build/device/* 2>/dev/null || true
tar cJf build/device/lib.tar.xz -C build/device lib && rm -rf build/device/lib
ls -la build/device
