"""The `auto` preset and a messy blog-post config train on 2 real ranks (tests/distributed/workers/train_messy_ds.py)
and write a resolved config DeepSpeed accepts. The other presets' engines: zero2 and zero3 under the recipe's
launches (tests/distributed/test_recipe_distributed.py), zero1 and zero3_offload in the cross-engine oracle
(tests/distributed/test_engines.py: stage, optimizer, offload devices, the same run as DDP)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run, walk
from ..ds_support import deepspeed_accepts

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_messy_ds.py"
# The `auto` budget per rank. The tiny model has under 1M parameters (tests/unit/test_tiny_model.py), so by the ZeRO
# paper's accounting in fp32 even plain data parallelism needs 16 bytes x 1M = 16 MB of model states per rank: with a
# 64 GiB budget every stage fits, and "the least sharded configuration that fits" is ZeRO stage 0.
AUTO_BUDGET = 64 * 2**30
AUTO_STAGE = 0


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir, tmp_path_factory):
    """One 2-rank launch of train_messy_ds.py training the ``auto`` preset then the messy config: by config, its
    folder."""
    out = tmp_path_factory.mktemp("two_rank_runs")
    run(launcher_cmd(TRAIN_LAUNCHER, SCRIPT) + ["--model", str(tiny_model_dir), "--out", str(out), "--config", "auto",
                                                "messy", "--memory_per_device", str(AUTO_BUDGET)])  # fmt: skip
    return lambda config: out / config


def test_the_auto_preset_trains_on_two_ranks(two_rank_runs, tiny_model_dir):
    from transformers import BlenderbotForConditionalGeneration

    out = two_rank_runs("auto")
    probe = json.loads((out / "probe.json").read_text())
    assert probe["engine"] == "DeepSpeedEngine" and probe["world_size"] == 2 and probe["global_step"] == 5
    assert 16 * probe["num_params"] < 16 * 10**6 < AUTO_BUDGET  # the premise of AUTO_BUDGET
    assert (probe["zero_stage"], probe["offload_optimizer"], probe["offload_param"]) == (AUTO_STAGE, "none", "none")
    assert "Zero" not in probe["optimizer"], probe["optimizer"]  # stage 0: DeepSpeed's basic optimizer
    losses = probe["losses"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    written = json.loads((out / "deepspeed_config.resolved.json").read_text())
    assert [key for key, value in walk(written) if value == "auto"] == []
    deepspeed_accepts(written, world_size=2)
    # the saved model loads, and training changed it
    trained = BlenderbotForConditionalGeneration.from_pretrained(out).state_dict()
    initial = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir).state_dict()
    changed = [k for k in initial if not torch.equal(initial[k], trained[k])]
    assert len(changed) > 0.8 * len(initial)


def test_messy_config_trains_on_two_ranks_and_writes_the_resolved_file(two_rank_runs):
    out = two_rank_runs("messy")
    probe = json.loads((out / "probe.json").read_text())
    assert probe["engine"] == "DeepSpeedEngine" and probe["world_size"] == 2 and probe["zero_stage"] == 3
    assert probe["global_step"] == 5
    # the top-level "gradient_checkpointing" really checkpoints: each step runs the layer again during backward
    assert probe["activation_checkpointing"] and probe["forward_calls_fc1"] == 2 * probe["global_step"]

    written = json.loads((out / "deepspeed_config.resolved.json").read_text())
    assert [key for key, value in walk(written) if value == "auto"] == []
    deepspeed_accepts(written, world_size=2)
    zero = written["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # from the deprecated fp16 spelling
    assert zero["stage3_max_live_parameters"] == 10**9  # moved in from top level, as an int
    assert zero["reduce_bucket_size"] == probe["hidden_size"] ** 2
    assert "bf16" in written and "bfloat16" not in written and "gradient_checkpointing" not in written
    assert written["train_batch_size"] == 2 * written["train_micro_batch_size_per_gpu"]
    assert written["scheduler"]["params"]["total_num_steps"] == probe["global_step"]
