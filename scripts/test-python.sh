#!/usr/bin/env bash
# The Python package's tests (docs/python.md): installs the package's build and test
# dependencies from PyPI, builds and installs the package (`pip install .`, through ccache when
# CMAKE_CXX_COMPILER_LAUNCHER=ccache is set), then runs pytest on tests/python.
#
# torch and transformers are large: torch's Linux wheel pulls its CUDA libraries even on a
# machine without a GPU (it does not import without them), about 5 GB and a few minutes the
# first time; later runs find them installed. An install already running in the background
# (.ci/run starts one while C++ builds) holds the same lock, so this waits for it.
#
# Usage: scripts/test-python.sh [--deps-only]
set -euo pipefail
cd "$(dirname "$0")/.."
# A Python that refuses packages outside a virtual environment (PEP 668: Debian's and
# Ubuntu's own python3) gets one in build/venv; pyenv's, conda's or a venv's are used as they are.
deps=(nanobind scikit-build-core numpy pytest "torch>=2.11" "transformers>=5.17,<6" gguf accelerate)
py=python3
exec 9> "${TMPDIR:-/tmp}/cumulus-pip.lock"
flock 9
stdlib=$(python3 -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
if [ -f "${stdlib}/EXTERNALLY-MANAGED" ]; then
  [ -x build/venv/bin/python ] || python3 -m venv build/venv
  py=build/venv/bin/python
fi
"$py" -m pip install -q --root-user-action=ignore "${deps[@]}"
flock -u 9
[ "${1:-}" = --deps-only ] && exit 0
[ $# -eq 0 ] || { echo "usage: scripts/test-python.sh [--deps-only]" >&2; exit 2; }
"$py" -m pip install -q --root-user-action=ignore --no-build-isolation .
"$py" -m pytest -q tests/python
