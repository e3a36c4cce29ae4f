#!/usr/bin/env bash
# SmolLM2-135M on the GPU machine (docs/cuda.md "SmolLM2 on the GPU"). Its GGUF is 98 MB and
# one device call carries at most 64 MiB (the working tree included), so it travels in two
# pieces over two calls of one warm machine (it goes back 30 s after a call):
#   here:  mkdir -p .devmA .devmB (both in .git/info/exclude)
#          head -c 44000000 models/SmolLM2-135M-Instruct.Q4_1.gguf > .devmA/smollm2.part
#          tail -c +44000001 models/SmolLM2-135M-Instruct.Q4_1.gguf > .devmB/smollm2.part
#   call 1 carries .devmA (with the binaries) and copies it out of the checkout, e.g. to
#   /work/xfer: the next call's copy of the checkout drops ignored paths it does not carry,
#   while the machine's other folders stay;
#   call 2, right after, carries .devmB and runs this script with both pieces' paths.
# The pieces are joined and checked against scripts/fetch-model.sh's sha256 before use. Then:
# the GPU-vs-CPU logits test on SmolLM2, `eval kl --device cuda` at 8K on both texts of
# ../shared/data/text (every GPU method at P = 0.9, sketch_topp also with its step cost rule
# off), the same run on the machine's CPU for dense, tactic sinks=4 and sketch_topp, and
# `generate --bench --device cuda` at 8K, decode methods and then the flexprefill prefill.
#
# Files in $OUT: smollm2_tests.log, eval_{gpu,cpu}_<text>.{md,json}, bench_gpu{,_flex}.{log,json}.
# Usage (on the device machine, from the repository root, after run_runtime.sh set up BIN):
#   [BIN=build-device] [TEXTS=dir] tools/device/run_smollm2.sh PART_A PART_B
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
B=${BIN:-$PWD/build-device}
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
M=/work/main/models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /work/main/models
cat "$1" "$2" > "$M" || exit 1
echo "$SHA  $M" | sha256sum --check || { echo "SmolLM2 pieces do not join to the published file"; exit 1; }
if [ -n "${TEXTS:-}" ]; then
  mkdir -p /work/shared/data/text
  for t in "$TEXTS"/*.txt; do ln -sfn "$(cd "$(dirname "$t")" && pwd)/$(basename "$t")" /work/shared/data/text/; done
fi
T=/work/shared/data/text
timeout 120 "$B/cumulus_cuda_tests" --gtest_color=no --gtest_filter='CudaSmolLM2.*' > "$OUT/smollm2_tests.log" 2>&1
echo "smollm2 tests rc $?"
grep -E "^\[ *(FAILED|PASSED|SKIPPED|       OK) *\]|Failure|Expected|Which is|model \]" "$OUT/smollm2_tests.log" | head -20
for text in pg1342_pride_and_prejudice pg2701_moby_dick; do
  timeout 150 "$B/cumulus" eval kl --device cuda --model "$M" --text "$T/$text.txt" --context 8192 \
    --method dense,tactic,tactic_s4=tactic,sketch_topp,sk_gpu=sketch_topp,psa,quest,oracle_topp \
    --param tactic_s4.sinks=4 --param sk_gpu.gpu_dense_mib=0 \
    --markdown "$OUT/eval_gpu_$text.md" --json "$OUT/eval_gpu_$text.json"
  echo "eval gpu $text rc $?"
  grep -E "^\|" "$OUT/eval_gpu_$text.md" | head -16
  grep -E "runtime|total" "$OUT/eval_gpu_$text.md"
done
timeout 200 "$B/cumulus" eval kl --model "$M" --text "$T/pg1342_pride_and_prejudice.txt" --context 8192 \
  --threads "$(nproc)" --method dense,tactic_s4=tactic,sketch_topp --param tactic_s4.sinks=4 \
  --markdown "$OUT/eval_cpu_pg1342_pride_and_prejudice.md" --json "$OUT/eval_cpu_pg1342_pride_and_prejudice.json"
echo "eval cpu rc $?"
grep -E "^\|" "$OUT/eval_cpu_pg1342_pride_and_prejudice.md" | head -10
timeout 120 "$B/cumulus" generate --model "$M" --device cuda --prompt-file "$T/pg1342_pride_and_prejudice.txt" --bench \
  --bench-context 8000 --bench-decode 64 --method dense,tactic_s4=tactic,sketch_topp,sk_gpu=sketch_topp,quest \
  --param tactic_s4.sinks=4 --param sk_gpu.gpu_dense_mib=0 --json "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
echo "generate bench rc $?"
tail -20 "$OUT/bench_gpu.log"
timeout 90 "$B/cumulus" generate --model "$M" --device cuda --prompt-file "$T/pg1342_pride_and_prejudice.txt" --bench \
  --bench-context 8000 --bench-decode 16 --prefill flexprefill --json "$OUT/bench_gpu_flex.json" > "$OUT/bench_gpu_flex.log" 2>&1
echo "generate bench flexprefill rc $?"
tail -8 "$OUT/bench_gpu_flex.log"
