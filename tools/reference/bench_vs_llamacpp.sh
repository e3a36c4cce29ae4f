#!/usr/bin/env bash
# cumulus vs llama.cpp on the same GGUF, machine and thread count, in one run: prefill and
# decode tokens/s at several context lengths, dense attention, and the ratio.
#
#   llama.cpp: llama-bench (built by tools/reference/build_llamacpp.sh)
#     prefill: -p N -n 0         N prompt tokens from an empty cache, one batch of N (-b/-ub N)
#     decode:  -p 0 -n G -d N    G tokens generated one at a time after an untimed prefill
#                                of depth N (the K/V cache holds N..N+G-1 tokens)
#   cumulus:   cumulus generate --bench --bench-context N --bench-decode G
#     prefill: N tokens (chunks of 256), timed; then G decode steps, timed
# Both feed random token ids (llama-bench's way; speed does not depend on the text) and
# keep K/V in f16. llama.cpp's flash attention is left at its default (auto = on for CPU).
# Repetitions: llama-bench reports the mean, cumulus the median, of R runs each.
#
# Usage: tools/reference/bench_vs_llamacpp.sh [OUT_DIR]
#   env: MODEL (models/SmolLM2-135M-Instruct.Q4_1.gguf), CONTEXTS (512,2048,8192),
#        THREADS (2), DECODE (32), REPS (3), CUMULUS (build/release/cumulus)
# Prints both engines' figures and the ratios; writes llamacpp_*.json, cumulus.json and
# comparison.json to OUT_DIR (default out/bench_vs_llamacpp).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${ROOT}"
MODEL="${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
CONTEXTS="${CONTEXTS:-512,2048,8192}"
THREADS="${THREADS:-2}"
DECODE="${DECODE:-32}"
REPS="${REPS:-3}"
CUMULUS="${CUMULUS:-build/release/cumulus}"
BENCH="${CUMULUS_REFERENCE_DIR:-${ROOT}/.reference}/llamacpp-build/bin/llama-bench"
OUT="${1:-out/bench_vs_llamacpp}"
mkdir -p "${OUT}"

[[ -x "${BENCH}" ]] || { echo "bench_vs_llamacpp: no ${BENCH}: run tools/reference/build_llamacpp.sh" >&2; exit 1; }
[[ -x "${CUMULUS}" ]] || { echo "bench_vs_llamacpp: no ${CUMULUS}: build the release preset" >&2; exit 1; }
[[ -f "${MODEL}" ]] || { echo "bench_vs_llamacpp: no ${MODEL}: run scripts/fetch-model.sh" >&2; exit 1; }

echo "bench_vs_llamacpp: load before: $(cut -d' ' -f1-3 /proc/loadavg); $(nproc) cores; threads ${THREADS}"
MAXCTX=$(tr ',' '\n' <<<"${CONTEXTS}" | sort -n | tail -n1)

# Prefill: one llama-bench process per context so the batch can hold the whole prompt.
for n in ${CONTEXTS//,/ }; do
  echo "bench_vs_llamacpp: llama.cpp prefill ${n}" >&2
  "${BENCH}" -m "${MODEL}" -t "${THREADS}" -p "${n}" -n 0 -b "${n}" -ub "$(( n < 512 ? n : 512 ))" -r "${REPS}" \
    -o json > "${OUT}/llamacpp_prefill_${n}.json"
done
echo "bench_vs_llamacpp: llama.cpp decode at depths ${CONTEXTS}" >&2
"${BENCH}" -m "${MODEL}" -t "${THREADS}" -p 0 -n "${DECODE}" -d "${CONTEXTS}" -b "$(( MAXCTX < 2048 ? MAXCTX : 2048 ))" \
  -r "${REPS}" -o json > "${OUT}/llamacpp_decode.json"

echo "bench_vs_llamacpp: cumulus" >&2
"${CUMULUS}" generate --model "${MODEL}" --bench --bench-context "${CONTEXTS}" --bench-decode "${DECODE}" \
  --repetitions "${REPS}" --threads "${THREADS}" --json "${OUT}/cumulus.json" | tee "${OUT}/cumulus.txt"

echo "bench_vs_llamacpp: load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "${OUT}" "${CONTEXTS}" <<'PY'
import glob, json, os, sys
out, contexts = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
pp = {}
for path in glob.glob(os.path.join(out, "llamacpp_prefill_*.json")):
    for r in json.load(open(path)):
        if r["n_gen"] == 0:
            pp[r["n_prompt"]] = r["avg_ts"]
tg = {r["n_depth"]: r["avg_ts"] for r in json.load(open(os.path.join(out, "llamacpp_decode.json"))) if r["n_gen"] > 0}
cu = {r["context"]: r for r in json.load(open(os.path.join(out, "cumulus.json")))["runs"] if r["method"] == "dense"}
rows = []
print(f"\n{'context':>8} | {'prefill t/s llama.cpp':>21} {'cumulus':>9} {'ratio':>6} | "
      f"{'decode t/s llama.cpp':>20} {'cumulus':>9} {'ratio':>6}")
for c in contexts:
    r = {"context": c, "llamacpp_prefill_tok_s": pp.get(c), "cumulus_prefill_tok_s": cu[c]["prefill_tok_s"],
         "llamacpp_decode_tok_s": tg.get(c), "cumulus_decode_tok_s": cu[c]["decode_tok_s"]}
    r["prefill_ratio"] = r["cumulus_prefill_tok_s"] / r["llamacpp_prefill_tok_s"] if r["llamacpp_prefill_tok_s"] else None
    r["decode_ratio"] = r["cumulus_decode_tok_s"] / r["llamacpp_decode_tok_s"] if r["llamacpp_decode_tok_s"] else None
    rows.append(r)
    f = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"
    print(f"{c:>8} | {f(r['llamacpp_prefill_tok_s']):>21} {f(r['cumulus_prefill_tok_s']):>9} "
          f"{f(r['prefill_ratio'], 2):>6} | {f(r['llamacpp_decode_tok_s']):>20} {f(r['cumulus_decode_tok_s']):>9} "
          f"{f(r['decode_ratio'], 2):>6}")
print("ratio = cumulus / llama.cpp (above 1: cumulus faster)")
json.dump({"rows": rows, "loadavg_end": open("/proc/loadavg").read().split()[:3]},
          open(os.path.join(out, "comparison.json"), "w"), indent=2)
PY
