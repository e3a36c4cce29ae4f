#!/usr/bin/env bash
# The Python package on the GPU machine (docs/python.md): installs a CUDA wheel built
# elsewhere, runs tests/python (test_cuda.py on CUDA tensors; the CPU tests too), then
# bench/transformers_bench.py on a random-weight llama3-8b-shaped model at 32K and 128K
# (SDPA against cumulus dense and sketch_topp). One device call.
#
# The GPU machine has torch and transformers but not the package's C++ dependencies, and
# its Python (3.12) may differ from the build machine's. So the wheel is built on a machine
# with scripts/setup.sh's packages and that Python, with the CUDA backend:
#   python3.12 -m pip wheel --no-build-isolation --no-deps -w DIR \
#       -C build-dir=build/python-cuda -C cmake.define.CUMULUS_CUDA=ON .
# and DIR gets lib.tar.xz: lib/ holding the shared libraries the module needs that a bare
# CUDA image lacks (libopenblas, libhwy, libfmt, libgfortran, libquadmath; cuBLAS is the
# image's), and the gguf wheel (pure Python) for the GGUF tests.
#
# Usage (on the device machine, from the repository root):
#   WHEELS=DIR [CONTEXTS=32768,131072] [METHODS=dense,sketch_topp] tools/device/python_gpu.sh
# Files in $OUT: pytest.log, bench.txt, bench.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
WHEELS=${WHEELS:?give WHEELS=DIR (the CUDA wheel, lib.tar.xz, the gguf wheel)}
mkdir -p "$OUT"
SITE=$(mktemp -d)
tar xJf "$WHEELS/lib.tar.xz" -C "$SITE"
export LD_LIBRARY_PATH="$SITE/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl || exit 1
# The package's Python files from this tree (the wheel may predate them).
cp python/cumulus/*.py "$SITE/cumulus/"
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cumulus, torch, transformers; print('cumulus cuda', cumulus.has_cuda, '| torch', torch.__version__, '| transformers', transformers.__version__)" || exit 1
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/python 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 420 python3 bench/transformers_bench.py --shape llama3-8b --device cuda --dtype bf16 \
  --contexts "${CONTEXTS:-32768,131072}" --methods "${METHODS:-dense,sketch_topp}" --new-tokens 32 --rounds 2 \
  --json "$OUT/bench.json" 2>&1 | grep -v Warning | tee "$OUT/bench.txt"
