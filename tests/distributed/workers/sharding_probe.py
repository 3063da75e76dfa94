"""Train one epoch of a tiny BlenderBot and record, per rank, which examples each step's batch held."""

import json
import os
import sys

import torch.distributed as dist
from deepspeed.comm import comm as ds_comm
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

from chat_e.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from hf_ext import Seq2SeqTrainer, Seq2SeqTrainingArguments, end_distributed

model_dir, out_dir, deepspeed = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
args = Seq2SeqTrainingArguments(
    output_dir=out_dir,
    per_device_train_batch_size=4,
    num_train_epochs=1,
    report_to=[],
    save_strategy="no",
    logging_steps=1000,
    seed=7,
    deepspeed=deepspeed,
)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
data_args = DataArguments(n_train=48, max_source_length=64)
raw = load_dialogue_dataset(data_args)["train"]
dataset = tokenize_dataset(raw, tokenizer, data_args)
model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
collate = DataCollatorForSeq2Seq(tokenizer, model=model)
seen = []


def recording_collator(features):
    seen.extend(tokenizer.decode(f["input_ids"], skip_special_tokens=True) for f in features)
    return collate(features)


trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=recording_collator)
trainer.train()
rank = dist.get_rank() if dist.is_initialized() else 0
with open(os.path.join(out_dir, f"seen-rank{rank}.json"), "w") as f:
    json.dump(
        {
            "seen": seen,
            "all": [tokenizer.decode(x, skip_special_tokens=True) for x in dataset["input_ids"]],
            "engine": type(trainer.model_wrapped).__name__,
            "shm_comm_op": getattr(ds_comm.cdb, "shm_comm_op", None) is not None,
        },
        f,
    )
end_distributed()
