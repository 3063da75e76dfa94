"""hf-ext's TrainingArguments start DeepSpeed's comm layer (hf_ext.runtime.start_deepspeed_comm): a script that never
calls ``deepspeed.init_distributed`` gets a 2-rank comm and ZeRO-3 partitioned models before any Trainer exists."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hf_ext.runtime import has_accelerator

from ..conftest import ROOT, launcher_cmd, run

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "comm_probe.py"


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_training_arguments_start_deepspeed_comm_and_zero3_partitions(launcher, tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    cmd = launcher_cmd(launcher, SCRIPT)
    run(cmd + [str(tiny_model_dir), str(tmp_path)])
    # on CPUs DeepSpeed's shm comm op ran, and hf-ext's end_distributed left no workspace of it in /dev/shm (RAM)
    port = cmd[cmd.index("--master_port") + 1]
    ranks = [json.loads((tmp_path / f"comm-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["shm_comm_op"] == ranks[1]["shm_comm_op"] == (not has_accelerator())
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    full = config.vocab_size * config.d_model  # the shared embedding's shape, from the model's config
    for rank in (0, 1):
        result = json.loads((tmp_path / f"comm-rank{rank}.json").read_text())
        assert result["ds_comm_initialized"] is True
        assert result["ds_world_size"] == result["torch_world_size"] == 2
        for built in ("from_pretrained", "from_config"):
            weight = result[built]
            assert weight["ds_numel"] == full, built  # zero.Init knows the full size ...
            assert weight["local_numel"] < full, built  # ... the rank does not hold it ...
            assert weight["partition_numel"] == math.ceil(full / 2), built  # ... only its half
            assert weight["loaded_whole_line"] is None, built  # and nothing warns of a model loaded whole
