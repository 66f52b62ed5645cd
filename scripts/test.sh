#!/usr/bin/env bash
# Installs what is missing or out of date (scripts/install.sh; about a second when nothing is) and
# runs the whole test suite, spread over the machine's cores by pytest-xdist, then prints the
# slowest tests. GPU tests (marker `gpu`) are skipped where no CUDA device is present.
#
#   TEST_WORKERS=N   pytest-xdist workers (default: auto, one per core); 0 runs in one process.
#                    With workers, torch runs one thread per worker (OMP_NUM_THREADS=1 unless set).
#   Extra arguments go to pytest (a path, -k EXPR, -x, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export ENGINE_CACHE_DIR="${ENGINE_CACHE_DIR:-$(mktemp -d)}"
# Bytecode is cached (__pycache__/, git-ignored) even where the environment says not to: the suite
# starts a few hundred Python processes (servers, engine ranks, CLI runs, the docs' blocks), and
# without caches each one compiles every engine module it imports and pytest re-rewrites the
# asserts of every test module it loads (core/tests/test_cli_imports.py: 24.2 -> 20.8 CPU-s).
unset PYTHONDONTWRITEBYTECODE
workers=${TEST_WORKERS:-auto}
parallel=()
if [ "$workers" != 0 ]; then
  # loadgroup: the root conftest puts each module in one group (its module- and session-scoped
  # servers and checkpoints start once) and orders the slow groups first, which
  # --no-loadscope-reorder keeps (xdist would otherwise order groups by their number of tests).
  parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
  # One compute thread per worker, inherited by the servers a test starts: workers already fill the
  # cores, and torch's OpenMP threads spinning beside another worker's cost a test 2-3x its time.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
python3 -m pytest -q -p no:cacheprovider --durations=30 "${parallel[@]}" "$@"
