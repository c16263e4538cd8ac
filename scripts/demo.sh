#!/usr/bin/env bash
# `make demo`: the main job on this host.
#   1. llmdiag doctor: what works here and what to do about each gap;
#   2. llmdiag collect: a few snapshots from every collector that can run
#      (engines found on local ports, or given with BACKENDS="http://h:p ...").
set -uo pipefail
cd "$(dirname "$0")/.."
LLMDIAG=.venv/bin/llmdiag
args=()
for url in ${BACKENDS:-}; do args+=(--backend "$url"); done

"$LLMDIAG" "${args[@]}" doctor
echo
echo "== llmdiag collect --duration ${DEMO_SECONDS:-5} (Ctrl-C to stop) =="
exec "$LLMDIAG" "${args[@]}" collect --duration "${DEMO_SECONDS:-5}"
