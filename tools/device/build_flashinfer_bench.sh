#!/usr/bin/env bash
# Builds tools/device/flashinfer_decode_bench.cu here (FlashInfer's paged
# decode beside ours and cuDNN). FlashInfer's decode kernels are header-only templates in the
# flashinfer-python wheel (its JIT compiles them with nvcc on first use); this downloads the
# wheel into a scratch folder, takes flashinfer/data/include and the CCCL it ships (its
# headers need a newer libcu++ than CUDA 13.0's) from it, and compiles the
# benchmark for sm_90a. Nothing of FlashInfer enters the repository or the CI.
#
# Usage: tools/device/build_flashinfer_bench.sh [OUT_DIR]   (default build/flashinfer)
#   FLASHINFER_VERSION (default 0.7.2), NVCC (default nvcc)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-build/flashinfer}
ver=${FLASHINFER_VERSION:-0.7.2}
mkdir -p "$out"
scratch="$out/wheel"
if [ ! -d "$scratch/flashinfer/data/include" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform any -d "$scratch" "flashinfer-python==$ver"
  (cd "$scratch" && unzip -q -o flashinfer_python-"$ver"-*.whl 'flashinfer/data/include/*' 'flashinfer/data/cccl/*')
fi
"${NVCC:-nvcc}" -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I "$scratch/flashinfer/data/include" \
  -I "$scratch/flashinfer/data/cccl/libcudacxx/include" -I "$scratch/flashinfer/data/cccl/cub" \
  -I "$scratch/flashinfer/data/cccl/thrust" \
  --expt-relaxed-constexpr -o "$out/flashinfer_decode_bench" tools/device/flashinfer_decode_bench.cu
echo "built $out/flashinfer_decode_bench (FlashInfer $ver)"
