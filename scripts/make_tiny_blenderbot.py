#!/usr/bin/env python
"""Build a random-init BlenderBot with a byte-level BPE tokenizer trained on the offline corpus.

    python scripts/make_tiny_blenderbot.py --output_dir runs/models/tiny [--size tiny|small|400m] [--seed 0]
    python scripts/make_tiny_blenderbot.py --chat --output_dir runs/models/tiny_chat [--seed 0]

Sizes: ``tiny`` (well under 1M parameters, for tests), ``small`` (a few million, learns the offline corpus in a few
CPU minutes; used by ``make demo``), ``400m`` (facebook/blenderbot-400M-distill's dimensions, for benchmarks).
The directory loads with ``AutoTokenizer`` / ``BlenderbotForConditionalGeneration.from_pretrained`` and carries
BlenderBot's generation defaults.

``--chat`` builds the tiny decoder-only stand-in for SmolLM2-135M-Instruct instead: a random-init ``LlamaForCausalLM``
(tied embeddings) with SmolLM2's ChatML special tokens and chat template, loadable with ``AutoModelForCausalLM``.
The real SmolLM2 comes from ``scripts/make_smollm2.py``.
"""

from __future__ import annotations

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer, BlenderbotForConditionalGeneration

from chat_e.data.models import CHAT_SIZES, SIZES, build, build_chat_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="a tiny ChatML LlamaForCausalLM instead of a BlenderBot")
    args = parser.parse_args(argv)
    if args.chat and args.size not in CHAT_SIZES:
        parser.error(f"--chat builds sizes {sorted(CHAT_SIZES)}, not {args.size!r}")
    out = (build_chat_model if args.chat else build)(args.output_dir, args.size, args.seed)
    # prove the directory loads the way users will load it
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = (AutoModelForCausalLM if args.chat else BlenderbotForConditionalGeneration).from_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    kind = "ChatML decoder" if args.chat else "BlenderBot"
    print(f"Wrote {args.size} {kind} ({n_params:,} parameters, vocab {len(tokenizer)}) to {out}")


if __name__ == "__main__":
    main()
