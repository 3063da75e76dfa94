"""``hf-ext export --format gguf`` in a process that SIGKILLs itself at the K-th write event (the header, the
metadata, the tensors written; the rename), or lists the events of an uninterrupted export.

    python gguf_kill.py SRC OUT --gguf_type f16 (--kill_at K | --list FILE)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import gguf

from hf_ext.atomic import os as atomic_os
from hf_ext.cli import main as cli_main

EVENTS: list[str] = []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--gguf_type", default="f16")
    parser.add_argument("--kill_at", type=int, default=None)
    parser.add_argument("--list", default=None)
    opts = parser.parse_args()

    def event(name: str) -> None:
        EVENTS.append(name)
        if opts.kill_at is not None and len(EVENTS) == opts.kill_at:
            print(f"SIGKILL at GGUF export event {opts.kill_at} ({name})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def after(owner, name, label):
        original = getattr(owner, name)

        def wrapped(*a, **k):
            result = original(*a, **k)
            event(label)
            return result

        setattr(owner, name, wrapped)

    after(gguf.GGUFWriter, "write_header_to_file", "header written")
    after(gguf.GGUFWriter, "write_kv_data_to_file", "metadata written")
    after(gguf.GGUFWriter, "write_tensors_to_file", "tensors written")
    original_replace = atomic_os.replace
    atomic_os.replace = lambda *a, **k: (event("rename"), original_replace(*a, **k))[1]
    code = cli_main(["export", opts.src, "--out", opts.out, "--format", "gguf", "--gguf_type", opts.gguf_type])
    if opts.list:
        with open(opts.list, "w") as f:
            json.dump(EVENTS, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
