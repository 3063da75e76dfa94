#!/usr/bin/env python
"""Preference fine-tuning of a chat model: DPO (default) or KTO (``--loss kto``) with TRL's trainers on hf-ext.

    # offline, SPIN pairs from real human chit-chat on the tiny random-init chat model
    deepspeed --num_gpus 2 recipes/preference.py --config recipes/configs/preference_tiny.yaml --output_dir runs/pref
    # after `make demo`: the fine-tuned SmolLM2 in runs/demo, LoRA, ZeRO-2 (what `make demo-preference` runs)
    deepspeed --num_gpus 2 recipes/preference.py --config recipes/configs/preference_demo.yaml
    # your own pairs (prompt/chosen/rejected; for KTO prompt/completion/label), plain text or TRL's conversational rows
    deepspeed --num_gpus 2 recipes/preference.py --config recipes/configs/preference_tiny.yaml --data_file rows.jsonl

The recipe is installed with Chat-E: its code is :mod:`chat_e.training.preference` (data, SPIN pairs, TRL's trainer,
evaluation before and after), and ``chat-e train --method dpo`` (or ``kto``) runs it without a clone. This script is
the recipe's command line.
"""

import sys

from chat_e.training.preference import run

if __name__ == "__main__":
    run(sys.argv[1:])
