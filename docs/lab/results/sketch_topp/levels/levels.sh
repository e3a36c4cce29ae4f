cd /work/ci-check
for L in 16 8 4; do
  echo "== bench L=$L"; CUMULUS_SKETCH_LEVELS=$L build/release/cumulus bench --shape llama3-8b --context 32768 --threads 2 --methods dense,sketch_topp,oracle_topp --steps 16 --repeats 1 2>&1 | grep -E "^(dense|sketch_topp|oracle_topp) "
done
for L in 16 8 4; do
  echo "== kl L=$L"; CUMULUS_SKETCH_LEVELS=$L build/release/cumulus eval kl --model models/SmolLM2-135M-Instruct.Q4_1.gguf --text ../shared/data/text/pg1342_pride_and_prejudice.txt --context 8192 --weights f32 --method dense,sketch_topp 2>&1 | tail -6
done
