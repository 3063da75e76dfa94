"""Train one epoch of a tiny BlenderBot and record, per rank, which examples (by row index) its batches held."""

import json
import os
import sys

import torch.distributed as dist
from deepspeed.comm import comm as ds_comm
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration, DataCollatorForSeq2Seq

from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
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
    remove_unused_columns=False,  # keep the row index for the collator, which drops it
)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
data_args = DataArguments(n_train=48, max_source_length=64)
raw = load_dialogue_dataset(data_args)["train"]
dataset = tokenize_dataset(raw, tokenizer, data_args)
dataset = dataset.add_column("row", list(range(len(dataset))))  # the corpus repeats some contexts: count rows
model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
collate = DataCollatorForSeq2Seq(tokenizer, model=model)
seen = []


def recording_collator(features):
    seen.extend(f["row"] for f in features)
    return collate([{k: v for k, v in f.items() if k != "row"} for f in features])


trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=dataset, data_collator=recording_collator)
trainer.train()
rank = dist.get_rank() if dist.is_initialized() else 0
with open(os.path.join(out_dir, f"seen-rank{rank}.json"), "w") as f:
    json.dump(
        {
            "seen": seen,
            "rows": len(dataset),
            "engine": type(trainer.model_wrapped).__name__,
            "shm_comm_op": getattr(ds_comm.cdb, "shm_comm_op", None) is not None,
        },
        f,
    )
end_distributed()
