#!/usr/bin/env bash
# Runs the `cumulus` binary on a list of bad inputs, grouped by category, and prints the
# table in docs/reliability.md: per category how many inputs, how many ended in a clear
# error (non-zero exit below 124, a message naming the option or file, within 10 s), and how
# many did anything else (exit 0, a timeout, a signal). Every command's first message line
# goes to build/bad_inputs.log. A case whose arguments start with '@' is a bash command line
# (`"$CLI"` the binary): resource limits (`ulimit -v`, `ulimit -u`), redirections to
# /dev/full or a full tmpfs, empty arguments. CI runs this script (.ci/run).
#
# Usage: tools/reliability/bad_inputs.sh [CUMULUS_BINARY]   (default build/release/cumulus)
# Needs ../shared (stories260K, texts); the GGUF rows need models/ (scripts/fetch-model.sh).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLI="$(realpath "${1:-${ROOT}/build/release/cumulus}")"
S="${ROOT}/../shared/data/models/stories260K/stories260K.bin"
TOK="${ROOT}/../shared/data/models/stories260K/tok512.bin"
T="${ROOT}/../shared/data/text/tinyshakespeare_input.txt"
M="${ROOT}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
LOG="${ROOT}/build/bad_inputs.log"
W="$(mktemp -d)"
trap 'rm -rf "${W}"' EXIT
mkdir -p "${ROOT}/build"
: > "${LOG}"

# Scratch inputs: junk, empty, truncated and padded copies of real files.
head -c 4096 /dev/urandom > "${W}/random.bin"
: > "${W}/empty"
printf ' \n\t\n  \n' > "${W}/blank.txt"
head -c 100 "${S}" > "${W}/s_truncated.bin"
{ cat "${S}"; printf 'x'; } > "${W}/s_padded.bin"
head -c 100 "${TOK}" > "${W}/tok_truncated.bin"
{ cat "${TOK}"; printf 'xyz'; } > "${W}/tok_padded.bin"
mkdir -p "${W}/lonely" && cp "${S}" "${W}/lonely/"
[ -f "${M}" ] && head -c 200000 "${M}" > "${W}/m_truncated.gguf"
# The GGUF with one tensor renamed (blk.3.attn_q.weight -> blk.3.attn_X.weight): it parses, but
# a tensor the model needs is missing.
[ -f "${M}" ] && python3 - "${M}" "${W}/m_renamed.gguf" <<'PY'
import sys
b = bytearray(open(sys.argv[1], "rb").read())
at = b.find(b"blk.3.attn_q.weight")
b[at + 10] = ord("X")
open(sys.argv[2], "wb").write(b)
PY
# A trace whose header claims 4 records of 4M tokens (tens of GB) in a 160 KB file.
python3 - "${W}/trace_claims.bin" <<'PY'
import struct, sys
h = b'{"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "n_tokens": 4000000, "prompt_tokens": 3999000, ' \
    b'"steps": 1000, "layers": [0, 1, 2, 3]}'
open(sys.argv[1], "wb").write(b"CUMTRACE" + struct.pack("<II", 1, len(h)) + h + bytes(160000))
PY
printf 'CUMTRACE\002\000\000\000' > "${W}/trace_version.bin"
# Copies that outputs may name (a case must never reach the real fixtures), and a FIFO with
# no writer (open() of it blocks).
mkdir -p "${W}/own" && cp "${S}" "${TOK}" "${W}/own/" && cp "${T}" "${W}/own/t.txt"
OS="${W}/own/stories260K.bin"
OT="${W}/own/t.txt"
mkfifo "${W}/fifo"
# A full file system for outputs: a 1-MiB tmpfs filled up (needs root and mount; else /dev/full
# stands in for the stdout cases only).
FULL=""
if mkdir -p "${W}/full" && mount -t tmpfs -o size=1m tmpfs "${W}/full" 2>/dev/null; then
  FULL="${W}/full"
  head -c 2m /dev/zero > "${FULL}/fill" 2>/dev/null
fi
trap '[ -n "${FULL}" ] && umount "${W}/full"; rm -rf "${W}"' EXIT
# `ulimit -u` binds only a user other than root: root runs that case as nobody.
# Without setpriv, root cannot run it: skipped (exit 99 below).
AS_USER=""
NPROC_SKIP=0
if [ "$(id -u)" -eq 0 ]; then
  if command -v setpriv > /dev/null; then AS_USER="setpriv --reuid=65534 --regid=65534 --clear-groups"; else NPROC_SKIP=1; fi
fi
export CLI
LONG="$(printf 'n%.0s' $(seq 250))"

G="generate --model ${S} --quiet --max-tokens 4"
E="eval kl --model ${S} --text ${T}"
CASES=(
  # model files
  "model|generate --model ${W}/none.bin"
  "model|generate --model ${W}"
  "model|generate --model ${W}/empty"
  "model|generate --model ${W}/random.bin"
  "model|generate --model ${W}/s_truncated.bin"
  "model|generate --model ${W}/s_padded.bin"
  "model|generate --model /dev/null"
  "model|generate --model /dev/zero"
  "model|eval kl --model ${W}/random.bin --text ${T}"
  "model|info --model ${W}"
  "model|generate --model ${W}/m_truncated.gguf"
  "model|info --model ${W}/m_renamed.gguf"
  # tokenizers
  "tokenizer|${G} --tokenizer ${W}"
  "tokenizer|${G} --tokenizer ${W}/none.bin"
  "tokenizer|${G} --tokenizer ${W}/empty"
  "tokenizer|${G} --tokenizer ${W}/random.bin"
  "tokenizer|${G} --tokenizer ${W}/tok_truncated.bin"
  "tokenizer|${G} --tokenizer ${W}/tok_padded.bin"
  "tokenizer|generate --model ${W}/lonely/stories260K.bin"
  "tokenizer|generate --model ${M} --tokenizer ${TOK}"
  "tokenizer|eval kl --model ${M} --tokenizer ${TOK} --text ${T}"
  # texts and prompts
  "text|${G} --prompt-file ${W}"
  "text|${G} --prompt-file ${W}/none.txt"
  "text|${G} --prompt-file /dev/zero"
  "text|${G} --prompt x --prompt-file ${T}"
  "text|eval kl --model ${S} --text ${W}"
  "text|eval kl --model ${S} --text ${W}/none.txt"
  "text|eval niah --model ${S} --text /dev/zero --lengths 256 --depths 0.5"
  "text|eval kl --model ${S} --text ${W}/blank.txt"
  # methods and parameters
  "method|${G} --method nosuch"
  "method|${G} --method dense,tactic,x=nosuch"
  "method|${G} --method flexprefill"
  "method|${G} --method x=tactic,x=psa"
  "method|${G} --method =tactic"
  "method|${G} --method tactic --param nokey=1"
  "method|${G} --method tactic --param p=2"
  "method|${G} --method tactic --param p"
  "method|${G} --method tactic --param p=0.9 --param p=0.8"
  "method|${G} --method tactic --param psa.threshold=0.9"
  "method|${G} --prefill tactic"
  "method|${G} --prefill flexprefill --prefill-param gamma=0.9 --prefill-param gamma=0.8"
  "method|${G} --prefill flexprefill --prefill-param nokey=1"
  "method|${E} --method dense=tactic"
  "method|${E} --method tactic --sweep nokey=1,2"
  "method|${E} --method tactic --sweep p=0.5,"
  "method|eval matched --model ${S} --text ${T} --method quest"
  "method|eval matched --model ${S} --text ${T} --baselines tactic"
  "method|eval mass --model ${S} --text ${T} --method tactic"
  "method|bench --methods nosuch"
  "method|bench --param quest.budget=64 --param quest.budget=128"
  "method|bench --param nosuch.k=1"
  # numbers
  "number|${G} --threads 0"
  "number|${G} --threads 257"
  "number|${G} --threads -1"
  "number|${G} --seed -1"
  "number|${G} --seed abc"
  "number|generate --model ${S} --max-tokens 0"
  "number|generate --model ${S} --max-tokens 600"
  "number|${G} --page-size 3"
  "number|${G} --temperature -1"
  "number|${G} --device-kv-gib -1"
  "number|${G} --device-kv-gib 4"
  "number|${G} --top-p 0"
  "number|${G} --kv-dtype f8"
  "number|${G} --weights q2"
  "number|${G} --bench --bench-context 100000 --bench-decode 2"
  "number|${G} --bench --bench-context 512 --bench-decode 2"
  "number|${G} --bench --bench-context 0"
  "number|${G} --bench --bench-decode 0"
  "number|${G} --bench --repetitions 0"
  "number|${E} --threads 0"
  "number|${E} --seed -1"
  "number|${E} --context 100000"
  "number|${E} --steps 0"
  "number|eval niah --model ${S} --text ${T} --lengths 1024"
  "number|eval niah --model ${S} --text ${T} --depths 1.5"
  "number|bench --threads 0"
  "number|bench --seed -1"
  "number|bench --context 10"
  "number|bench --membw-mib 100000000"
  "number|trace --profile-synthetic smollm2-135m --p 2"
  # comma lists with an empty item (CLI11's splitting dropped it)
  "list|${G} --bench --bench-context 64,,128 --bench-decode 2"
  "list|eval niah --model ${S} --text ${T} --lengths 256, --depths 0.5"
  "list|eval niah --model ${S} --text ${T} --lengths 256 --depths ,0.5"
  "list|eval mass --model ${S} --text ${T} --targets 0.5,,0.9"
  "list|eval matched --model ${S} --text ${T} --baselines quest,"
  "list|bench --methods dense,,tactic"
  "list|trace --model ${M} --text ${T} --layers 1,,2 --out ${W}/t.bin"
  # output paths
  "output|${E} --markdown /nonexistent/x.md"
  "output|${E} --json /nonexistent/x.json"
  "output|${E} --json ${W}"
  "output|${E} --svg-dir /dev/null/plots"
  "output|${E} --svg-dir ${W}/random.bin"
  "output|bench --json /nonexistent/x.json"
  "output|${G} --bench --bench-context 64 --bench-decode 2 --json /nonexistent/x.json"
  "output|${G} --json ${W}/x.json"
  "output|trace --model ${S} --text ${T} --out /nonexistent/t.bin"
  # traces
  "trace|trace --profile ${W}/none.bin"
  "trace|trace --profile ${W}"
  "trace|trace --profile ${W}/random.bin"
  "trace|trace --profile ${W}/empty"
  "trace|trace --profile ${W}/trace_claims.bin"
  "trace|trace --profile ${W}/trace_version.bin"
  # an output that is an input or another output (the copies in own/)
  "same file|eval kl --model ${OS} --text ${OT} --json ${OS}"
  "same file|eval kl --model ${OS} --text ${OT} --markdown ${OT}"
  "same file|eval kl --model ${OS} --text ${OT} --json ${W}/r --markdown ${W}/r"
  "same file|generate --model ${OS} --prompt-file ${OT} --kv-save ${OT}"
  "same file|generate --model ${OS} --kv-save ${W}/own/tok512.bin"
  "same file|eval kl --model ${OS} --text ${OT} --kv-save ${W}/own/../own/t.txt"
  # an empty path ("not given" to a script with an unset variable)
  "empty path|@exec \"\$CLI\" ${G} --kv-load ''"
  "empty path|@exec \"\$CLI\" ${G} --kv-save ''"
  "empty path|@exec \"\$CLI\" ${G} --prompt-file ''"
  "empty path|@exec \"\$CLI\" ${E} --json ''"
  "empty path|@exec \"\$CLI\" ${E} --markdown ''"
  "empty path|@exec \"\$CLI\" ${E} --svg-dir ''"
  "empty path|@exec \"\$CLI\" ${E} --kv-load ''"
  # a FIFO with no writer (open() would block), a device
  "special file|${G} --kv-load ${W}/fifo"
  "special file|generate --model ${W}/fifo"
  "special file|info --model ${W}/fifo"
  "special file|${G} --tokenizer ${W}/fifo"
  "special file|trace --profile ${W}/fifo"
  "special file|${G} --kv-load /dev/zero"
  # resource limits and write failures: each must end in an error naming it within seconds
  "resource|@ulimit -v 100000; exec \"\$CLI\" ${G}"
  "resource|@ulimit -v 300000; OPENBLAS_NUM_THREADS=1 exec \"\$CLI\" eval kl --model ${M} --text ${T} --context 2048 --weights f32"
  "resource|@ulimit -v 700000; OPENBLAS_NUM_THREADS=1 exec \"\$CLI\" generate --model ${M} --quiet --max-tokens 8000 --kv-dtype f32 --method dense,tactic,quest,streaming,psa,lfps,oracle_topk"
  "resource|@[ ${NPROC_SKIP} = 0 ] || exit 99; ulimit -u 20; exec ${AS_USER} \"\$CLI\" ${G} --threads 64"
  "resource|@exec \"\$CLI\" ${G} > /dev/full"
  "resource|@exec \"\$CLI\" info --model ${S} > /dev/full"
  "resource|@exec \"\$CLI\" ${E} --context 128 --steps 4 --method dense > /dev/full"
  "resource|@exec \"\$CLI\" methods > /dev/full"
  "resource|@[ -n \"${FULL}\" ] || exit 99; exec \"\$CLI\" ${E} --context 128 --steps 4 --method dense --json ${FULL}/r.json"
  "resource|@[ -n \"${FULL}\" ] || exit 99; exec \"\$CLI\" ${G} --kv-save ${FULL}/k.kvsnap"
  "resource|${G} --bench --bench-context 64 --bench-decode 2 --json ${W}/${LONG}"
  # messages
  "message|${G} --method tactic --param p=1e-400"
  # command line
  "command|frobnicate"
  "command|generate"
  "command|generate --model ${S} --no-such-option"
  "command|eval nosuch --model ${S} --text ${T}"
  "command|"
)

declare -A total clear other
order=()
for c in "${CASES[@]}"; do
  cat="${c%%|*}"
  args="${c#*|}"
  [[ -v "total[${cat}]" ]] || { order+=("${cat}"); total[${cat}]=0; clear[${cat}]=0; other[${cat}]=0; }
  total[${cat}]=$(( total[${cat}] + 1 ))
  # Fresh copies for every "same file" case: a binary that lets an output overwrite an input
  # must not spoil the cases after it.
  [ "${cat}" = "same file" ] && cp "${S}" "${TOK}" "${W}/own/" && cp "${T}" "${OT}"
  if [ "${args:0:1}" = "@" ]; then
    out="$(cd "${W}" && timeout 10 bash -c "${args:1}" 2>&1)"
  else
    # shellcheck disable=SC2086  # args are words
    out="$(cd "${W}" && timeout 10 "${CLI}" ${args} 2>&1)"
  fi
  rc=$?
  if [ "${rc}" -eq 99 ]; then  # a case this machine cannot set up (no tmpfs mount)
    total[${cat}]=$(( total[${cat}] - 1 ))
    echo "skip  ${cat}: ${args}" >> "${LOG}"
    continue
  fi
  first="$(printf '%s\n' "${out}" | grep -m1 -E 'error|--|required|Value|not' || printf '%s\n' "${out}" | head -n1)"
  if [ "${rc}" -ne 0 ] && [ "${rc}" -lt 124 ] && [ -n "${first}" ]; then
    clear[${cat}]=$(( clear[${cat}] + 1 ))
    echo "ok    rc=${rc} ${cat}: cumulus ${args}" >> "${LOG}"
  else
    other[${cat}]=$(( other[${cat}] + 1 ))
    echo "OTHER rc=${rc} ${cat}: cumulus ${args}" >> "${LOG}"
  fi
  echo "      ${first:0:300}" >> "${LOG}"
done

echo "| category | inputs | clear error, non-zero exit | anything else |"
echo "|---|---:|---:|---:|"
all=0; allc=0
for cat in "${order[@]}"; do
  echo "| ${cat} | ${total[${cat}]} | ${clear[${cat}]} | ${other[${cat}]} |"
  all=$(( all + total[${cat}] )); allc=$(( allc + clear[${cat}] ))
done
echo "| all | ${all} | ${allc} | $(( all - allc )) |"
echo "(per command: ${LOG})"
[ "${allc}" -eq "${all}" ]
