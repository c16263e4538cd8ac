#!/usr/bin/env bash
# `make demo`: the main job on this host.
#   1. llmdiag doctor: what works here and what to do about each gap;
#   2. engines found on local ports (or given as BACKENDS="http://h:p ..."):
#        on a terminal: llmdiag top on them (q quits);
#        otherwise: llmdiag diagnose on them for DEMO_SECONDS (default 30);
#      none found: the embedded fleet of fake engines with its fault script (KV loss, a throttled
#      GPU, impatient clients cancelling over HTTP and gRPC, a client without keep-alive, a crash):
#        on a terminal: llmdiag top --demo (q quits and stops everything it started);
#        otherwise (CI, pipes, DEMO_HEADLESS=1): llmdiag demo, the headless report.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${LLMDIAG_VENV:-.venv}
LLMDIAG=$VENV/bin/llmdiag
args=()
for url in ${BACKENDS:-}; do args+=(--backend "$url"); done

"$LLMDIAG" "${args[@]}" doctor
echo
found=${#args[@]}
if [ "$found" = 0 ]; then
    found=$("$VENV/bin/python" -c 'from llmdiag.collectors.discovery import discover_engines; print(len(discover_engines()))' 2>/dev/null || echo 0)
fi
interactive=0
if [ -t 0 ] && [ -t 1 ] && [ -z "${DEMO_HEADLESS:-}" ]; then interactive=1; fi
if [ "$found" != 0 ] && [ "$interactive" = 1 ]; then
    echo "== llmdiag top on the engines of this host (q quits) =="
    "$LLMDIAG" "${args[@]}" top
elif [ "$found" != 0 ]; then
    echo "== llmdiag diagnose --duration ${DEMO_SECONDS:-30} on the engines of this host =="
    "$LLMDIAG" "${args[@]}" diagnose --duration "${DEMO_SECONDS:-30}"
elif [ "$interactive" = 1 ]; then
    echo "== no inference engines found on this host: llmdiag top --demo (embedded fleet of fake vLLM engines; q quits) =="
    "$LLMDIAG" top --demo
else
    echo "== no inference engines found on this host: llmdiag demo (embedded fleet of fake vLLM engines) =="
    "$LLMDIAG" demo --duration "${DEMO_SECONDS:-60}"
fi
rc=$?
# diagnose/demo exit 1 (warning) or 2 (critical) when they found something: that is the
# demo working, not make failing. Anything else is a real error.
case $rc in
    0) echo "(exit code 0: healthy)" ;;
    1|2) echo "(llmdiag exit code $rc: $([ $rc = 1 ] && echo warning || echo critical) diagnoses found)"; rc=0 ;;
esac
exit $rc
