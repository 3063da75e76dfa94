"""The exit abort with torch alone: 2 gloo ranks, one collective on the world group and one on a subgroup, then the
variant's teardown and exit. No transformers, DeepSpeed or hf-ext code runs but ``hf_ext.end_distributed`` in the
``hf-ext`` variant.

    torchrun --nproc_per_node 2 -m benchmarks.exit_torch_worker --variant stock --out DIR

``--variant``: ``stock`` ends without a teardown (as transformers' example scripts do); ``previous`` calls
``torch.distributed.destroy_process_group()`` but keeps a Python reference to the subgroup (as DeepSpeed's comm layer
keeps its groups); ``hf-ext`` calls ``hf_ext.end_distributed()``. ``--model`` and ``--steps`` are accepted and
ignored (the bench passes them to every worker). Each rank writes ``OUT/exit.rank<N>.json`` as its last statement.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

KEPT = []  # a module global, as a library's reference to its process groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", required=True, choices=["hf-ext", "previous", "stock"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=None)
    opts = parser.parse_args()

    started = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    group = dist.new_group(list(range(world)))
    dist.all_reduce(torch.ones(4), group=group)
    KEPT.append(group)
    if opts.variant == "hf-ext":
        import hf_ext

        hf_ext.end_distributed()
    elif opts.variant == "previous":
        dist.destroy_process_group()
    result = {"rank": rank, "variant": opts.variant, "engine": "gloo", "zero_stage": None, "dtensor_params": 0,
              "world_size": world, "torn_down_seconds": time.perf_counter() - started}  # fmt: skip
    (Path(opts.out) / f"exit.rank{rank}.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
