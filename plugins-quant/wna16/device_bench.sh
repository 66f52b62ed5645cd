#!/usr/bin/env bash
# The wna16 GPU run (one device call): GPU tests and the kernel benchmark, logs under $OUT.
#   bash plugins-quant/wna16/device_bench.sh sweep   # wna16 GPU tests + bench --alts (text lines)
#   bash plugins-quant/wna16/device_bench.sh final   # wna16/awq/gptq/ct GPU tests + bench --alts JSON
#                                                    # (+ gate_up/down at M = 1024, 4096)
# Tests and compiles run first, in parallel processes (Triton's on-disk cache), so the timing run
# that follows compiles nothing and shares the GPU with nothing. BUDGET: seconds for all of it.
set -u
OUT=${OUT:-/tmp/wna16-out}
mkdir -p "$OUT"
start=$(date +%s)
left() { echo $(( ${BUDGET:-230} - ($(date +%s) - start) )); }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=$PWD/.cache/triton-wna16 ENGINE_CACHE_DIR=/tmp/wna16-engine-cache
B=plugins-quant/wna16/bench_kernels.py
W=plugins-quant/wna16/tests
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
mode=${1:-sweep}
t_tests=$(( $(left) * 6 / 10 ))
pids=()
pt() { local name=$1; shift; timeout $t_tests python -m pytest -q -p no:cacheprovider -m gpu "$@" > "$OUT/gpu_tests_$name.log" 2>&1 & pids+=($!); }
pt a $W -k "llama_8b and 128-False"
pt b $W -k "llama_8b and 128-True"
pt c $W -k "llama_8b and 32-"
pt d $W -k "not llama_8b"
[ "$mode" = final ] && pt e plugins-quant/awq plugins-quant/gptq plugins-quant/compressed-tensors
for s in gate_up o qkv down; do
  timeout $(( t_tests - 5 )) python $B --alts --warm --shapes $s > "$OUT/warm_$s.log" 2>&1 & pids+=($!)
done
[ "$mode" = final ] && { timeout $(( t_tests - 5 )) python $B --alts --warm --shapes gate_up down --batches 1024 4096 \
  > "$OUT/warm_large.log" 2>&1 & pids+=($!); }
for p in "${pids[@]}"; do wait "$p"; done
echo "tests and compiles done at $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
if [ "$mode" = sweep ]; then
  timeout $(( $(left) - 5 )) python $B --alts --brief --rep-ms 10 > "$OUT/sweep.log" 2>&1
else
  timeout $(( $(left) - 25 )) python $B --alts --rep-ms 15 > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
  echo "bench rc $? at $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
  timeout $(( $(left) - 3 )) python $B --alts --rep-ms 15 --shapes gate_up down --batches 1024 4096 \
    > "$OUT/bench_large.jsonl" 2>> "$OUT/bench.err"
fi
echo "bench rc $? at $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
for f in "$OUT"/gpu_tests_*.log; do echo "$f: $(tail -1 "$f")"; done >> "$OUT/times.txt"
