"""Two nodes on loopback: ``torchrun --nnodes 2 --node_rank {0,1} --rdzv_endpoint 127.0.0.1:PORT``, one rank each,
ZeRO-3 and FSDP2 — training, checkpoints, a resume and a save that loads, as a user with two machines would run them;
and the same ZeRO-3 training under ``accelerate launch --machine_rank {0,1}`` with a two-machine config.

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
from ..saving_support import assert_same_tensors, parameter_names

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"


#: accelerate's DeepSpeed multi-node config: "standard" starts each node's processes like torchrun (DeepSpeed's own
#: pdsh launcher would need ssh)
ACCELERATE_TWO_NODES = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: hf_ext/deepspeed/presets/zero3.json
  zero3_init_flag: true
  deepspeed_multinode_launcher: standard
main_training_function: main
num_machines: 2
num_processes: 2
rdzv_backend: static
same_network: true
main_process_ip: 127.0.0.1
main_process_port: {port}
"""


def node_command(launcher: str, node: int, port: int, out: Path) -> list[str]:
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
                "--rdzv_endpoint", f"127.0.0.1:{port}", str(SCRIPT)]  # fmt: skip
    config = out.parent / f"{out.name}.accelerate.yaml"
    config.write_text(ACCELERATE_TWO_NODES.format(port=port))
    return [str(BIN / "accelerate"), "launch", "--config_file", str(config), "--machine_rank", str(node), str(SCRIPT)]


def two_nodes(model_dir, out: Path, *extra: str, launcher: str = "torchrun") -> None:
    """Start both nodes' launchers at once and wait for both; fail with the tail of each node's output."""
    port = free_port()
    procs = []
    out.mkdir()
    for node in (0, 1):
        cmd = [*node_command(launcher, node, port, out), "--model", str(model_dir), "--out", str(out / "out"),
               "--stage", "3", "--no_dropout", "--epochs", "1", "--save_total_limit", "3",
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
    two_nodes(tiny_model_dir, root / "full")
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


def test_two_node_save_loads_and_equals_the_gathered_weights(runs, tiny_model_dir):
    from transformers import BlenderbotForConditionalGeneration

    gathered = torch.load(runs / "full" / "trained.pt")
    loaded = BlenderbotForConditionalGeneration.from_pretrained(runs / "full" / "out")
    params = dict(loaded.named_parameters(remove_duplicate=False))
    assert_same_tensors(params, gathered, parameter_names(tiny_model_dir))


def test_two_node_resume_ends_where_the_uninterrupted_run_did(runs, tiny_model_dir):
    info = json.loads((runs / "resumed" / "trained.pt.json").read_text())
    assert info["global_step"] == 8 and info["run"]["nodes"] == 2
    full, resumed = torch.load(runs / "full" / "trained.pt"), torch.load(runs / "resumed" / "trained.pt")
    assert_same_tensors(full, resumed, parameter_names(tiny_model_dir))  # same ranks, same sums: bit for bit


def test_accelerate_launch_on_two_nodes_trains_the_same_model(runs, tiny_model_dir):
    two_nodes(tiny_model_dir, runs / "accelerate", launcher="accelerate")
    info = json.loads((runs / "accelerate" / "trained.pt.json").read_text())
    run = info["run"]
    assert (run["launcher"], run["world_size"], run["nodes"], run["ranks_per_node"]) == ("accelerate", 2, 2, 1)
    assert (run["engine"], run["zero_stage"], info["global_step"]) == ("DeepSpeedEngine", 3, 8)
    torchrun, accelerate = torch.load(runs / "full" / "trained.pt"), torch.load(runs / "accelerate" / "trained.pt")
    assert_same_tensors(torchrun, accelerate, parameter_names(tiny_model_dir))


def test_fsdp_on_two_nodes_trains_saves_and_resumes(tiny_model_dir, tmp_path):
    """FSDP2 across two torchrun nodes: each node's rank holds half of every parameter, the save loads and equals
    torch's full state dict, and a resume from checkpoint-4 ends bit-identical."""
    from transformers import BlenderbotForConditionalGeneration

    two_nodes(tiny_model_dir, tmp_path / "full", "--fsdp", "full_shard")
    two_nodes(tiny_model_dir, tmp_path / "resumed", "--fsdp", "full_shard", "--resume",
              str(tmp_path / "full" / "out" / "checkpoint-4"))  # fmt: skip
    info = json.loads((tmp_path / "full" / "trained.pt.json").read_text())
    run = info["run"]
    assert (run["launcher"], run["world_size"], run["nodes"], run["ranks_per_node"]) == ("torchrun", 2, 2, 1)
    assert (run["engine"], run["fsdp"]["sharding_factor"], info["global_step"]) == ("FSDP2", 2, 8)
    full = torch.load(tmp_path / "full" / "trained.pt")  # torch's get_model_state_dict(full_state_dict=True)
    names = parameter_names(tiny_model_dir)
    assert set(full) == names
    node0, node1 = (torch.load(tmp_path / "full" / f"trained.pt.rank{r}.pt") for r in (0, 1))
    held = parameter_names(tiny_model_dir, remove_duplicate=True)
    assert set(node0) == set(node1) == held  # every parameter on each node
    assert [k for k in sorted(held) if not torch.equal(torch.cat([node0[k], node1[k]]), full[k])] == []
    loaded = dict(BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "full" / "out").named_parameters(
        remove_duplicate=False))  # fmt: skip
    assert_same_tensors(loaded, full, names)
    assert_same_tensors(full, torch.load(tmp_path / "resumed" / "trained.pt"), names)
