#!/usr/bin/env bash
# What a user without a clone gets: the wheel built from this checkout, installed with the `app` extra into a fresh
# venv in a temp folder outside the clone, then `chat-e train --help` and a tiny DPO run (a random-init tiny chat
# model built by the installed package, SPIN pairs from the chit-chat corpus, 4 steps, one process).
# Usage: scripts/check_wheel.sh [PYTHON]   (TORCH="torch==... --index-url ..." picks the torch build, as in make)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
TORCH=${TORCH:-torch==2.13.0}
work=$(mktemp -d /tmp/hf-ext-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
echo "== building the wheel"
"$PYTHON" -m pip wheel . --no-deps --quiet -w "$work/dist"
wheel=$(ls "$work"/dist/hf_ext-*.whl)
echo "== a fresh venv in $work, outside the clone: $TORCH, then $(basename "$wheel")[app]"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
# shellcheck disable=SC2086  # TORCH may carry an --index-url
"$work/venv/bin/python" -m pip install --quiet $TORCH
"$work/venv/bin/python" -m pip install --quiet "$wheel[app]"
cd "$work"
echo "== chat-e train --help"
"$work/venv/bin/chat-e" train --help | head -5
echo "== a tiny DPO run"
"$work/venv/bin/chat-e" train --method dpo --launcher python -- \
    --model_name_or_path "$work/models/tiny_chat" --build_model chat-tiny --dataset_name chitchat \
    --n_train 16 --n_eval 8 --max_source_length 96 --max_target_length 24 --spin_cache_dir "$work/spin" \
    --generation_batch_size 8 --generation_do_sample true --max_length 128 --per_device_train_batch_size 4 \
    --learning_rate 1e-3 --max_steps 4 --logging_steps 1 --save_strategy no --report_to none \
    --gradient_checkpointing false --output_dir "$work/out"
test -f "$work/out/model.safetensors"
test -f "$work/out/preference_metrics.json"
echo "== the installed wheel trained a DPO model outside the clone: $work/out"
