#!/usr/bin/env python
"""Fine-tune a dialogue model (BlenderBot or a decoder-only chat model) on multi-domain dialogues with DeepSpeed ZeRO.

    # the blog's run: facebook/blenderbot-400M-distill on smangrul/MuDoConv, ZeRO-2
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/blenderbot_400m.yaml
    # offline: a random-init tiny BlenderBot on the chatterbot corpus (see the YAML headers for every launcher)
    deepspeed --num_gpus 2 recipes/blenderbot.py --config recipes/configs/tiny.yaml --output_dir runs/tiny
    # Ray Train as the launcher (a local cluster, or the one RAY_ADDRESS names): 2 workers, or 1:2 elastic
    python recipes/blenderbot.py --config recipes/configs/tiny.yaml --deepspeed zero2 --launcher ray --num_workers 2

The recipe is installed with Chat-E: its code is :mod:`chat_e.training.dialogue` (parse args -> load data -> build
model -> build trainer -> train -> evaluate -> save -> report), and ``chat-e train --method sft`` runs it without a
clone. This script is the recipe's command line.
"""

import sys

from chat_e.training.dialogue import main, run

__all__ = ["main"]  # Ray Train's workers run this script's main() (hf_ext.ray.run_script)

if __name__ == "__main__":
    run(sys.argv[1:])
