#!/usr/bin/env bash
# Data-parallel replicas behind SGLang's router, one URL for clients:
#
#   scripts/serve-dp.sh N [launch.py flags]
#
# starts N servers (python launch.py, ports BASE_PORT .. BASE_PORT+N-1, each
# with the given flags) and, once they answer /health, sglang-router
# (python -m sglang_router.launch_router, PyPI `sglang-router`) on PORT with
# --policy POLICY in front of them. Environment: PORT (30000), BASE_PORT
# (PORT+1), POLICY (cache_aware), HOST (127.0.0.1), HEALTH_CHECK_INTERVAL (2 s).
#
# A replica that dies is dropped by the router at its next health check
# while the others serve (a request sent to it before that fails); the router dying, or SIGINT/SIGTERM to this script,
# stops everything (each replica drains as launch.py does on SIGTERM).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: scripts/serve-dp.sh N [launch.py flags]" >&2
  exit 2
fi
N=$1; shift
PY=${PYTHON:-python3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-30000}
BASE_PORT=${BASE_PORT:-$((PORT + 1))}
POLICY=${POLICY:-cache_aware}

pids=()
stop() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
}
trap stop EXIT
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM

urls=()
for ((i = 0; i < N; i++)); do
  port=$((BASE_PORT + i))
  "$PY" launch.py --host "$HOST" --port "$port" "$@" &
  pids+=($!)
  urls+=("http://$HOST:$port")
done
for url in "${urls[@]}"; do
  until "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=2)" "$url" 2>/dev/null; do
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "serve-dp: a replica exited before it was ready" >&2; exit 1; }
    done
    sleep 0.5
  done
done
# health checks every 2 s, one failure drops a replica: a dead one stops
# getting requests within ~2 s (before that, a request sent to it fails)
"$PY" -m sglang_router.launch_router --host "$HOST" --port "$PORT" --policy "$POLICY" \
  --health-check-interval-secs "${HEALTH_CHECK_INTERVAL:-2}" --health-failure-threshold 1 \
  --worker-urls "${urls[@]}" &
router=$!
pids+=("$router")
echo "serve-dp: $N replicas (${urls[*]}) behind sglang-router at http://$HOST:$PORT ($POLICY)"
set +e
wait "$router"
status=$?
echo "serve-dp: the router exited ($status); stopping the replicas" >&2
exit "$status"
