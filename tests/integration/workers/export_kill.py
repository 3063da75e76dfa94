"""``hf-ext export`` in a process that SIGKILLs itself at the K-th write event (a shard, the index, the fsync, the
swap; with ``--gguf_type``, ``--format gguf``'s: the header, the metadata, the tensors written, the rename), or lists
the events of an uninterrupted export.

    python export_kill.py SRC OUT --dtype bf16 --max_shard_size 200KB (--kill_at K | --list FILE)
    python export_kill.py SRC OUT.gguf --gguf_type f16 (--kill_at K | --list FILE)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import transformers.modeling_utils as modeling_utils

from hf_ext import atomic
from hf_ext.cli import main as cli_main

EVENTS: list[str] = []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--gguf_type", default=None)
    parser.add_argument("--kill_at", type=int, default=None)
    parser.add_argument("--list", default=None)
    opts = parser.parse_args()

    def event(name: str) -> None:
        EVENTS.append(name)
        if opts.kill_at is not None and len(EVENTS) == opts.kill_at:
            print(f"SIGKILL at export event {opts.kill_at} ({name})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def before(module, name, label):
        original = getattr(module, name)
        setattr(module, name, lambda *a, **k: (event(label), original(*a, **k))[1])

    def after(module, name, label):
        original = getattr(module, name)

        def wrapped(*a, **k):
            result = original(*a, **k)
            event(label)
            return result

        setattr(module, name, wrapped)

    if opts.gguf_type:
        import gguf

        after(gguf.GGUFWriter, "write_header_to_file", "header written")
        after(gguf.GGUFWriter, "write_kv_data_to_file", "metadata written")
        after(gguf.GGUFWriter, "write_tensors_to_file", "tensors written")
        before(atomic.os, "replace", "rename")
        argv = ["export", opts.src, "--out", opts.out, "--format", "gguf", "--gguf_type", opts.gguf_type]
    else:
        after(modeling_utils, "safe_save_file", "shard written")
        before(atomic, "fsync_tree", "fsync")
        before(atomic, "_exchange", "swap")
        after(atomic, "_exchange", "swapped")
        before(atomic.shutil, "rmtree", "remove")
        argv = ["export", opts.src, "--out", opts.out, "--max_shard_size", opts.max_shard_size]
    if opts.dtype:
        argv += ["--dtype", opts.dtype]
    code = cli_main(argv)
    if opts.list:
        with open(opts.list, "w") as f:
            json.dump(EVENTS, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
