# The two commands (see README): both do all set-up themselves, idempotently.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup lint bench clean

export LLMDIAG_VENV := $(VENV)

setup:
	@scripts/setup.sh

demo: setup
	@scripts/demo.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .benchmarks build *.egg-info
