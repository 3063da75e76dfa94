# hf-ext: `make demo` (set-up + fine-tune + samples) and `make test` (set-up + the whole suite).
PYTHON ?= python3
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" demo
TORCH ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf-ext-installed
DEMO_DIR ?= runs/demo
NPROC ?= 2

.PHONY: setup demo test test-fast lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[app,dev]"
	touch $@

demo: setup
	$(BIN)/python scripts/make_tiny_blenderbot.py --size small --output_dir runs/models/small
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/deepspeed --num_gpus $(NPROC) recipes/blenderbot.py \
		--config recipes/configs/demo.yaml --output_dir $(DEMO_DIR)

test: setup
	$(BIN)/python -m pytest tests

test-fast: setup
	$(BIN)/python -m pytest tests -m "not distributed"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf runs .pytest_cache
