#!/usr/bin/env bash
# Set-up on a lent GPU machine (no registry access): wheels carried in .whl, then the
# project installed editable without dependencies so entry points register.
set -euo pipefail
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
pkgs=(-e core)
for d in plugins/*/ plugins-attention/*/ plugins-quant/*/ plugins-models/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  case "$d" in *_template*) continue ;; esac
  pkgs+=(-e "$d")
done
python3 -m pip install -q --no-deps --no-build-isolation --no-index "${pkgs[@]}"
