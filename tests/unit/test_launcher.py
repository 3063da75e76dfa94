"""Which launcher started a process, from the variables each launcher sets (the launches themselves report it in
their run summary: tests/distributed/test_recipe_distributed.py, test_multinode.py, test_ray.py)."""

from __future__ import annotations

import pytest

from hf_ext.runtime import detect_launcher, restart_hazard

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


# torch's elastic agent's variables in a worker (LocalElasticAgent._start_workers); the launched preemption tests
# (tests/distributed/test_recipe_distributed.py) see the line in real torchrun and accelerate launches, and restart
# workers through a store per attempt
RESTARTS = {**TORCHRUN, "TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({**RESTARTS, "TORCHELASTIC_USE_AGENT_STORE": "True"}, True),  # static rendezvous, or c10d's shared store
        ({**RESTARTS, "TORCHELASTIC_USE_AGENT_STORE": "False"}, False),  # c10d, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
        ({**RESTARTS, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}, False),
        ({**RESTARTS, "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "1"}, False),  # nobody to reconnect to
        (ENVIRONMENTS["deepspeed"], False),
    ],
    ids=["shared-store", "store-per-attempt", "no-restarts", "one-rank", "deepspeed"],
)
def test_a_launch_whose_restarted_workers_share_the_agents_store_is_told_the_fix(env, said):
    line = restart_hazard(env)
    assert (line is not None) == said
    if said:
        assert "--rdzv-backend c10d" in line and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
