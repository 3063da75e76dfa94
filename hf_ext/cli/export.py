"""``hf-ext export SRC --out DIR [--merge] [--dtype bf16|fp16|fp32]``: parsing only; the work is
:func:`hf_ext.saving.export.export`."""

from __future__ import annotations

import argparse
import logging
import sys

from ..atomic import write_failure
from ..saving.gguf import GGUF_TYPES
from ..sizes import DEFAULT_MAX_SHARD_SIZE, SAVE_DTYPES

EXPORT_HELP = "Write a serving-ready model (weights, config, generation config, tokenizer) from a run or checkpoint."


def export_command_parser(subparsers):
    parser = subparsers.add_parser("export", help=EXPORT_HELP, description=EXPORT_HELP)
    parser.add_argument("src", help="a run's output_dir or a checkpoint directory")
    parser.add_argument("--out", required=True, help="directory to write the exported model to")
    parser.add_argument("--merge", action="store_true", help="merge a PEFT adapter into its base model")
    parser.add_argument(
        "--format",
        choices=("safetensors", "gguf"),
        default="safetensors",
        help="safetensors (default): a model directory; gguf: one file for llama.cpp (--out names the file; an "
        "adapter is merged), a Llama-architecture causal LM",
    )
    parser.add_argument(
        "--gguf_type",
        choices=GGUF_TYPES,
        default="f16",
        help="the GGUF file's weights (default f16); q8_0 and q4_k_m are made by llama.cpp's quantizer",
    )
    parser.add_argument(
        "--dtype", choices=sorted(SAVE_DTYPES), default=None, help="weights dtype (default: as stored)"
    )
    parser.add_argument("--base_model", default=None, help="base model of an adapter (default: from adapter_config)")
    parser.add_argument(
        "--max_shard_size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest safetensors shard (default: {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.set_defaults(func=export_command)
    return parser


def export_command(args: argparse.Namespace) -> int:
    from ..saving.export import export  # noqa: PLC0415 (torch and transformers: only once a command runs)

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.format == "gguf":
            from ..saving.export import export_gguf  # noqa: PLC0415 (torch and transformers: only once a command runs)

            print(export_gguf(args.src, args.out, args.gguf_type, base_model=args.base_model))
            return 0
        out = export(
            args.src,
            args.out,
            merge=args.merge,
            dtype=args.dtype,
            base_model=args.base_model,
            max_shard_size=args.max_shard_size,
        )
    except (FileNotFoundError, ValueError) as err:
        print(f"hf-ext export: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # a full disk, a file size limit, no permission: nothing of `--out` was changed
        reason = write_failure(err)
        if reason is None:
            raise
        print(
            f"hf-ext export: could not write {args.out} ({reason}); its previous content is intact.", file=sys.stderr
        )
        return 1
    print(out)
    return 0
