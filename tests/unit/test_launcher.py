"""Which launcher started a process, from the variables each launcher sets (the launches themselves report it in
their run summary: tests/distributed/test_recipe_distributed.py, test_multinode.py, test_ray.py)."""

from __future__ import annotations

import pytest

from hf_ext.runtime import detect_launcher

# the variables each launcher sets in its workers (a subset: the ones that tell them apart)
TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
ENVIRONMENTS = {
    "deepspeed": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "CROSS_RANK": "0", "LOCAL_SIZE": "2"},
    # ray.train.torch.config._set_torch_distributed_env_vars, in a Ray worker process (RAY_RAYLET_PID)
    "ray": {
        "RAY_RAYLET_PID": "123",
        "LOCAL_RANK": "0",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "0",
        "ACCELERATE_TORCH_DEVICE": "cpu",
    },  # fmt: skip
    "accelerate": {**TORCHRUN, "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_DEEPSPEED": "true"},
    "torchrun": TORCHRUN,
    "mpi": {"OMPI_COMM_WORLD_SIZE": "2"},
    "python": {},
}


@pytest.mark.parametrize("launcher", list(ENVIRONMENTS))
def test_each_launcher_is_told_apart(launcher):
    assert detect_launcher(ENVIRONMENTS[launcher]) == launcher
