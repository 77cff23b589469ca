#!/usr/bin/env bash
# Install what is missing, then start the server: scripts/serve.sh [launch.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" launch.py "$@"
