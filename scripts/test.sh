#!/usr/bin/env bash
# Install what is missing, then run the whole test suite: scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
