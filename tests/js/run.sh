#!/usr/bin/env bash
# Real-client tests of `diffgemma serve` on the tiny fixture model: installs the pinned openai SDK (npm ci), starts
# the server on a free port, runs every *.test.mjs with node:test, stops the server.
# Usage: tests/js/run.sh path/to/diffgemma      Exit 77 (CTest "skipped") when Node 20+ is missing.
set -euo pipefail
BIN=$(realpath "${1:?usage: run.sh path/to/diffgemma}")
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
cd "$HERE"

if ! command -v node >/dev/null || [ "$(node -p 'process.versions.node.split(".")[0]')" -lt 20 ]; then
  echo "run.sh: Node 20+ not found; skipping the client tests" >&2
  exit 77
fi
npm ci --no-audit --no-fund --prefer-offline >/dev/null

LOG=$(mktemp)
API_KEY=test-key
"$BIN" serve -m "$ROOT/tests/fixtures/tiny-v" --port 0 --api-key "$API_KEY" --max-body 65536 --queue-limit 80 \
  --enable-test-hooks --quiet >"$LOG" 2>&1 &
PID=$!
cleanup() {
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  rm -f "$LOG"
}
trap cleanup EXIT

# The server prints its URL once the socket is bound.
URL=""
for _ in $(seq 1 300); do
  URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$LOG" | head -1 || true)
  [ -n "$URL" ] && break
  kill -0 "$PID" 2>/dev/null || { echo "run.sh: server exited:" >&2; cat "$LOG" >&2; exit 1; }
  sleep 0.2
done
[ -n "$URL" ] || { echo "run.sh: server did not start:" >&2; cat "$LOG" >&2; exit 1; }
curl -sf "$URL/health" >/dev/null

status=0
BASE_URL="$URL" API_KEY="$API_KEY" MODEL=tiny-v SERVER_PID="$PID" \
  node --test --test-concurrency=1 ./*.test.mjs || status=$?
if ! kill -0 "$PID" 2>/dev/null; then
  echo "run.sh: the server died during the tests:" >&2
  cat "$LOG" >&2
  status=1
fi
[ "$status" -eq 0 ] || tail -50 "$LOG" >&2
exit "$status"
