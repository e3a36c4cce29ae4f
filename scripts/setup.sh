#!/usr/bin/env bash
# Installs cumulus's build dependencies from Debian packages (clang and its runtime are for
# the libFuzzer target in tools/fuzz; Python's headers, pip and venv for the Python package).
# Idempotent: packages already present are not reinstalled, and apt-get update runs only
# when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libhwy-dev nlohmann-json3-dev libcli11-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev libxxhash-dev
  clang libclang-rt-dev ccache
  python3-dev python3-pip python3-venv
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
