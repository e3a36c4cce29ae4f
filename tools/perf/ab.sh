#!/usr/bin/env bash
# Before/after in one run: two cumulus binaries (e.g. a build of the base commit and of the
# change) alternate ROUNDS times on the same two measurements, so this machine's bandwidth
# swings (36-60 GB/s) fall on both alike; compare the medians and the paired differences.
#   1. `cumulus generate --bench` on MODEL at CONTEXT: decode tokens/s (dense by default)
#   2. `cumulus bench --shape llama3-8b --context BENCH_CONTEXT`: dense ms/step
#
# Usage: tools/perf/ab.sh BEFORE_BIN AFTER_BIN
#   env: MODEL (models/SmolLM2-135M-Instruct.Q4_1.gguf), CONTEXT (2048), BENCH_CONTEXT (8192),
#        METHOD (dense), ROUNDS (6), THREADS (2)
set -uo pipefail
cd "$(dirname "$0")/../.."
A=${1:?usage: tools/perf/ab.sh BEFORE_BIN AFTER_BIN}
B=${2:?usage: tools/perf/ab.sh BEFORE_BIN AFTER_BIN}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
CONTEXT=${CONTEXT:-2048}
BENCH_CONTEXT=${BENCH_CONTEXT:-8192}
METHOD=${METHOD:-dense}
ROUNDS=${ROUNDS:-6}
THREADS=${THREADS:-2}
TEXT=../shared/data/text/pg1342_pride_and_prejudice.txt
echo "round side decode_tok_s bench_ms_per_step   (load $(cut -d' ' -f1-3 /proc/loadavg))"
for r in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    bin=$A; [ "$side" = after ] && bin=$B
    # decode t/s is the 4th column from the right (the table gained an index column).
    g=$("$bin" generate --model "$MODEL" --prompt-file "$TEXT" --bench --bench-context "$CONTEXT" --bench-decode 32 \
          --method "$METHOD" --threads "$THREADS" 2>/dev/null | awk -v m="$METHOD" '$1 == m {print $(NF - 3); exit}')
    k=$("$bin" bench --shape llama3-8b --context "$BENCH_CONTEXT" --methods "$METHOD" --threads "$THREADS" 2>/dev/null |
        awk -v m="$METHOD" '$1 == m {print $10; exit}')
    echo "$r $side ${g:-?} ${k:-?}"
  done
done
