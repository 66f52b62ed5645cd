#!/usr/bin/env bash
# The wna16 GPU run (one device call): GPU tests and the kernel benchmark, logs under $OUT.
#   bash plugins-quant/wna16/device_bench.sh sweep   # GPU tests of wna16 + bench with --alts (text)
#   bash plugins-quant/wna16/device_bench.sh final   # all wna16/awq/gptq/ct GPU tests + bench JSON
# Compiles first in one process per shape (Triton's cache), so the timing run compiles nothing.
set -u
OUT=${OUT:-/tmp/wna16-out}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( ${BUDGET:-230} - ($(date +%s) - start) )); }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=$PWD/.cache/triton-wna16 ENGINE_CACHE_DIR=/tmp/wna16-engine-cache
B=plugins-quant/wna16/bench_kernels.py
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
mode=${1:-sweep}
alts=(); [ "$mode" = sweep ] && alts=(--alts)
if [ "$mode" = sweep ]; then
  tests=(plugins-quant/wna16/tests)
else
  tests=(plugins-quant/wna16/tests plugins-quant/awq plugins-quant/gptq plugins-quant/compressed-tensors)
fi
timeout $(( $(left) / 2 )) python -m pytest -q -p no:cacheprovider -m gpu "${tests[@]}" > "$OUT/gpu_tests.log" 2>&1 &
tpid=$!
pids=()
for s in gate_up o qkv down; do
  timeout $(( $(left) / 2 - 10 )) python $B "${alts[@]}" --warm --shapes $s > "$OUT/warm_$s.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "warm done at $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
wait $tpid; echo "tests rc $? at $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
if [ "$mode" = sweep ]; then
  timeout $(( $(left) - 5 )) python $B --alts --brief --rep-ms 10 --shapes gate_up o qkv down > "$OUT/sweep.log" 2>&1
else
  timeout $(( $(left) - 5 )) python $B --rep-ms 20 > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
fi
echo "bench rc $? at $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
