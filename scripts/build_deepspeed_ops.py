"""Build DeepSpeed's CPU ops once, at set-up, instead of inside the first run that needs them.

    python scripts/build_deepspeed_ops.py      # make setup runs it (with the virtual environment's bin first on PATH)

On a CPU machine DeepSpeed compiles two C++ ops just in time, into ``~/.cache/torch_extensions``: its shared-memory
all-reduce (every launch loads it in ``deepspeed.init_distributed``) and its fused Adam (a config's ``"optimizer":
{"type": "AdamW"}``). Each takes 25-45 s on 2 cores, and every rank of the first run that needs it waits for it.

The compiled op is reused only while the command that built it is the same: ninja hashes each command line, and two
ninja versions hash them differently. A process that finds another ninja on its ``PATH`` (the system's, say, against
the virtual environment's) rebuilds the op; runs that alternate rebuild it every time. So this script, ``make``'s
targets and the test session (``tests/conftest.py``) all put the virtual environment's ``bin`` first on ``PATH``.

On a CUDA machine nothing is built here: DeepSpeed's CUDA ops need the CUDA toolkit and are DeepSpeed's to build
(``DS_BUILD_OPS=1 pip install deepspeed``, or just in time).
"""

from __future__ import annotations

import shutil
import sys
import time

from deepspeed.accelerator import get_accelerator

#: the op builders whose ops the CPU runs load (deepspeed/ops/op_builder/cpu)
CPU_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")


def main() -> int:
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        print(f"DeepSpeed's accelerator is {accelerator.device_name()}: no CPU op to build.")
        return 0
    print(f"Building DeepSpeed's CPU ops with {shutil.which('ninja')} (once; later runs load them):", flush=True)
    for name in CPU_OPS:
        builder = accelerator.create_op_builder(name)
        start = time.perf_counter()
        builder.load()
        print(f"  {builder.absolute_name()}: {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
