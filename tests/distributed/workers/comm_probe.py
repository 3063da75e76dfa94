"""Build hf-ext TrainingArguments with a ZeRO-3 config, then, before any Trainer exists, record whether DeepSpeed's
comm layer is up (and its CPU shm op, where it runs on CPUs) and whether models built through transformers are
partitioned at construction.

    torchrun --nproc_per_node 2 tests/distributed/workers/comm_probe.py MODEL_DIR OUT_DIR

This script never starts DeepSpeed's comm itself: hf-ext's TrainingArguments must have done it.
"""

import json
import os
import sys

import deepspeed.comm as ds_comm
import torch.distributed as dist
from deepspeed.comm import comm as ds_comm_state
from transformers import AutoConfig, AutoModelForSeq2SeqLM

import hf_ext
import hf_ext.memory.measure

model_dir, out_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
args = hf_ext.Seq2SeqTrainingArguments(
    output_dir=out_dir, deepspeed="zero3", per_device_train_batch_size=2, max_steps=1, report_to=[]
)
result = {
    "ds_comm_initialized": ds_comm.is_initialized(),
    "ds_world_size": ds_comm.get_world_size() if ds_comm.is_initialized() else None,
    "torch_world_size": dist.get_world_size() if dist.is_initialized() else None,
    # DeepSpeed's CPU shm comm op, which allocates a workspace in /dev/shm per rank
    "shm_comm_op": getattr(ds_comm_state.cdb, "shm_comm_op", None) is not None,
}
config = AutoConfig.from_pretrained(model_dir)
for name, build in (
    ("from_pretrained", lambda: AutoModelForSeq2SeqLM.from_pretrained(model_dir)),
    ("from_config", lambda: AutoModelForSeq2SeqLM.from_config(config)),
):
    model = build()
    weight = model.get_input_embeddings().weight
    result[name] = {
        "loaded_whole_line": hf_ext.memory.measure.loaded_whole_under_zero3(model, 2, 2),
        "ds_numel": getattr(weight, "ds_numel", None),
        "local_numel": weight.numel(),
        "partition_numel": weight.ds_tensor.numel() if hasattr(weight, "ds_tensor") else None,
    }
rank = dist.get_rank() if dist.is_initialized() else 0
with open(os.path.join(out_dir, f"comm-rank{rank}.json"), "w") as f:
    json.dump(result, f)
hf_ext.end_distributed()
