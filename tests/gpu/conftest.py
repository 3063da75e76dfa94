"""The GPU tier's launches: one GPU, one rank, bf16 (``make test-gpu``; ``make test`` never collects this folder).

``HF_EXT_GPU_DRYRUN=1`` runs the same tests on CPU (``make test-gpu-dryrun``), so that a borrowed GPU's minutes are
spent on results, not on a typo. The tests then check the same facts on CPU kernels; their printed numbers are not
the GPU's.

The launchers are started as ``python -m``: on a GPU machine whose packages were installed with ``pip --target`` the
console scripts (``torchrun``, ``deepspeed``) are not on PATH.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import GPU_DRYRUN, free_port

#: where the tier runs: the GPU, or the CPU in a dry run
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="session")
def _a_gpu_or_a_dry_run():
    assert DEVICE == "cuda" or GPU_DRYRUN, "the GPU tier needs a CUDA GPU (HF_EXT_GPU_DRYRUN=1 checks it on CPU)"


def one_gpu(launcher: str, script: str | Path) -> list[str]:
    """The command prefix that starts ``script`` as one rank on one GPU under ``launcher`` (torchrun or deepspeed)."""
    port = str(free_port())
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", port,
                str(script)]  # fmt: skip
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", port,
                str(script)]  # fmt: skip
    raise ValueError(launcher)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def report(name: str, **numbers) -> None:
    """One line per measured fact, for the closing note and docs/testing.md: printed (seen with ``-s``) and appended
    to ``$HF_EXT_GPU_REPORT`` when set (pytest-xdist's workers print nowhere; scripts/gpu_check.sh sets it)."""
    line = f"GPU-TIER {name}: {json.dumps(numbers, default=str)}"
    print(line, flush=True)
    if os.environ.get("HF_EXT_GPU_REPORT"):
        with open(os.environ["HF_EXT_GPU_REPORT"], "a") as f:
            f.write(line + "\n")
