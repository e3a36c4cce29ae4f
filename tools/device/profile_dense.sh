#!/usr/bin/env bash
# Our dense decode kernel against PyTorch cuDNN, and where its time goes (docs/cuda.md, "Our
# dense kernel against cuDNN"): the plan sweep with each context's CTA timeline, PyTorch's
# cuDNN and flash on the same shapes, then Nsight Compute's stall reasons and instruction
# counts of one tc8 launch at 8K and 32K, batch 1. Uses prebuilt binaries in build-device/
# (tools/device/prebuild.sh), as run.sh does.
#
# Files in $OUT: dense.log, dense.json, torch.log, torch.json, stall_<ctx>.txt.
# Usage (on the device machine, from the repository root): tools/device/profile_dense.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BIN=$PWD/build-device
[ -f "$BIN/lib.tar.xz" ] && [ ! -d "$BIN/lib" ] && tar xJf "$BIN/lib.tar.xz" -C "$BIN"
export LD_LIBRARY_PATH="$BIN/lib:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.mem --format=csv,noheader

timeout 150 "$BIN/cuda_decode_bench" --contexts 8192,32768,131072 --batches 1,4 --methods "" \
  --dense-plans tc8,tc4,simt8,simt4,tc8/c2,tc4/c2,simt4/c2,tc8/p0 --json "$OUT/dense.json" > "$OUT/dense.log" 2>&1
echo "bench rc $?"
grep -E "dense|context" "$OUT/dense.log"
PYTHONUNBUFFERED=1 timeout 100 python3 tools/device/torch_sdpa_bench.py --contexts 8192,32768,131072 --batches 1,4 \
  --backends cudnn,flash --json "$OUT/torch.json" > "$OUT/torch.log" 2>&1
echo "torch rc $?"
tail -14 "$OUT/torch.log"

NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
M=""
for s in long_scoreboard barrier short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle not_selected \
  selected tex_throttle membar sleeping dispatch_stall drain imc_miss branch_resolving no_instruction misc; do
  M="$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
M="${M#,},smsp__inst_executed.sum,smsp__inst_executed_pipe_tensor.sum,sm__cycles_elapsed.avg"
M="$M,smsp__warps_active.avg.per_cycle_active,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
for ctx in 8192 32768; do
  echo "== Nsight Compute: tc8, context $ctx, batch 1 (stall cycles per issued instruction, counts)"
  timeout 60 "$NCU" --clock-control none --metrics "$M" -k regex:attention_ --launch-count 1 \
    "$BIN/cuda_decode_bench" --contexts $ctx --batches 1 --iters 1 --warmup 0 --methods "" --dense-plans tc8 \
    --json /tmp/ncu_dense.json > "$OUT/stall_$ctx.txt" 2>&1
  grep -E "stalled|inst_executed|cycles_elapsed|warps_active|dram__" "$OUT/stall_$ctx.txt" |
    sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | awk '{print $1, $NF}' |
    sort -k2 -g -r
done
