#!/bin/sh
# The container's start: make sure bcc has kernel headers for the node's kernel (scripts/setup.sh in
# "headers" mode: nothing to do when the node's /lib/modules or kheaders are there; otherwise it links
# the image's generic headers, or says why it cannot), then run llmdiag with the container's arguments.
set -e
LLMDIAG_SETUP_MODE=headers /opt/llmdiag/src/scripts/setup.sh
exec /opt/llmdiag/venv/bin/llmdiag "$@"
