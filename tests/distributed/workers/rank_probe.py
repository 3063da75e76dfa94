"""What a rank sees of its own process, after the imports a rank makes: written to OUT/rank{RANK}.json (OUT/rank.json
where no ``RANK`` is set).

python tests/launched/ranks.py --nproc 2 --master_port PORT tests/distributed/workers/rank_probe.py OUT
python tests/launched/forked.py tests/distributed/workers/rank_probe.py OUT
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import resource
import signal
import sys
from pathlib import Path

import deepspeed  # noqa: F401 - the imports a rank makes, before it looks
import torch
import transformers.trainer  # noqa: F401

import hf_ext.runtime


def handler_name(sig: signal.Signals) -> str:
    handler = signal.getsignal(sig)
    return getattr(handler, "__name__", str(handler))


out = Path(sys.argv[1])
seen = {
    "env": dict(os.environ),
    "argv": sys.argv,
    "path0": sys.path[0],
    "main": __name__,
    "cwd": os.getcwd(),
    "process_group": os.getpgid(0),
    "handlers": {sig.name: handler_name(sig) for sig in signal.Signals if sig not in (signal.SIGKILL, signal.SIGSTOP)},
    "torch_threads": torch.get_num_threads(),
    "rlimits": {
        name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")
    },
    "launch_env": hf_ext.runtime.LAUNCH_ENV,  # what hf-ext read from the environment at import
    "random": random.random(),
    "parent": Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[1],
}
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{os.environ.get('RANK', '')}.json").write_text(json.dumps(seen))  # "rank.json" without ranks
# into a C stream of its own on stdout, which only the C runtime's exit flushes (a pipe: fully buffered): the line says
# that the process ended through the interpreter's whole exit, as a fresh one's does, not with _exit
libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
libc.fputs(f"C runtime's exit: {out}\n".encode(), ctypes.c_void_p(libc.fdopen(os.dup(1), b"w")))
