#!/usr/bin/env python
"""Build a random-init BlenderBot with a byte-level BPE tokenizer trained on the offline corpus.

    python recipes/make_tiny_blenderbot.py --output_dir runs/models/tiny [--size tiny|small|400m] [--seed 0]

Sizes: ``tiny`` (well under 1M parameters, for tests), ``small`` (a few million, learns the offline corpus in a few
CPU minutes; used by ``make demo``), ``400m`` (facebook/blenderbot-400M-distill's dimensions, for benchmarks).
The directory loads with ``AutoTokenizer`` / ``BlenderbotForConditionalGeneration.from_pretrained`` and carries
BlenderBot's generation defaults.
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer, BlenderbotForConditionalGeneration

from chat_e.models import SIZES, build


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = build(args.output_dir, args.size, args.seed)
    # prove the directory loads the way users will load it
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = BlenderbotForConditionalGeneration.from_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Wrote {args.size} BlenderBot ({n_params:,} parameters, vocab {len(tokenizer)}) to {out}")


if __name__ == "__main__":
    main()
