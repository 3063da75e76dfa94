"""Two nodes on loopback: ``torchrun --nnodes 2 --node_rank {0,1} --rdzv_endpoint 127.0.0.1:PORT``, one rank each,
ZeRO-3 — training, checkpoints, a resume and a save that loads, as a user with two machines would run them.

The two "nodes" are two torchrun agents on this host that only share the rendezvous endpoint and the output directory
(as two machines share a network filesystem); nothing tells hf-ext they are on one machine.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from ..conftest import BIN, ROOT, free_port, launch_env

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"


def two_nodes(model_dir, out: Path, *extra: str) -> None:
    """Start both nodes' torchrun agents at once and wait for both; fail with the tail of each node's output."""
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
               "--rdzv_endpoint", f"127.0.0.1:{port}", str(SCRIPT), "--model", str(model_dir), "--out",
               str(out / "out"), "--stage", "3", "--no_dropout", "--epochs", "1", "--save_total_limit", "3",
               "--dump", str(out / "trained.pt"), *extra]  # fmt: skip
        log = open(out.parent / f"{out.name}.node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=600))
        finally:
            log.close()
    if any(codes):
        tails = [Path(log.name).read_text()[-3000:] for _, log in procs]
        pytest.fail(f"two-node launch exited {codes}:\n" + "\n--- node 1 ---\n".join(tails))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_nodes")
    (root / "full").mkdir()
    two_nodes(tiny_model_dir, root / "full")
    (root / "resumed").mkdir()
    two_nodes(tiny_model_dir, root / "resumed", "--resume", str(root / "full" / "out" / "checkpoint-4"))
    return root


def test_two_nodes_train_and_say_so(runs):
    info = json.loads((runs / "full" / "trained.pt.json").read_text())
    assert info["global_step"] == 8
    run = info["run"]
    assert (run["launcher"], run["world_size"], run["nodes"], run["ranks_per_node"]) == ("torchrun", 2, 2, 1)
    assert (run["engine"], run["zero_stage"]) == ("DeepSpeedEngine", 3)
    assert sorted(p.name for p in (runs / "full" / "out").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    # each node's rank wrote its own partition of the checkpoint
    partitions = sorted(p.name for p in (runs / "full" / "out" / "checkpoint-4" / "global_step4").glob("*optim*"))
    assert partitions == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]


def test_two_node_save_loads_and_equals_the_gathered_weights(runs):
    from transformers import BlenderbotForConditionalGeneration

    gathered = torch.load(runs / "full" / "trained.pt")
    loaded = BlenderbotForConditionalGeneration.from_pretrained(runs / "full" / "out")
    params = dict(loaded.named_parameters(remove_duplicate=False))
    assert params.keys() == gathered.keys()
    assert all(torch.equal(params[k], gathered[k]) for k in gathered)


def test_two_node_resume_ends_where_the_uninterrupted_run_did(runs):
    info = json.loads((runs / "resumed" / "trained.pt.json").read_text())
    assert info["global_step"] == 8 and info["run"]["nodes"] == 2
    full, resumed = torch.load(runs / "full" / "trained.pt"), torch.load(runs / "resumed" / "trained.pt")
    assert all(torch.equal(full[k], resumed[k]) for k in full)  # same ranks, same order of sums: bit for bit
