#!/usr/bin/env bash
# Installs everything (scripts/install.sh) and runs the whole test suite.
# GPU tests (marker `gpu`) are skipped where no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export ENGINE_CACHE_DIR="${ENGINE_CACHE_DIR:-$(mktemp -d)}"
python3 -m pytest -q -p no:cacheprovider --durations=30 "$@"
