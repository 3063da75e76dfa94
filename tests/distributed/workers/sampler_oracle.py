"""The same run on 1 and 2 ranks, for each training sampler the recipe offers: a tiny Llama trained padding-free on
rows of varied lengths, at a global batch of 8 (1 rank: micro-batch 4 x accumulation 2; 2 ranks: 4 x 1), 2 epochs.

    torchrun --nproc_per_node 2 tests/distributed/workers/sampler_oracle.py --model DIR --out FILE --accum 1
    torchrun --nproc_per_node 1 tests/distributed/workers/sampler_oracle.py --model DIR --out FILE --accum 2

Writes ``FILE`` (JSON, rank 0): per sampler the per-step losses, grad norms and real tokens seen (summed over the
ranks: the same rows give the same count). Dropout is off (the model has none), so the two world sizes differ only in
the order fp32 sums the gradient.
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

import hf_ext
from benchmarks.worker import drop_trainer, restore_environment  # as the engine oracle's segments
from tests.distributed.workers.engine_oracle import publish

#: the recipe's choices of train_sampling_strategy (chat_e.training.dialogue.DialogueTrainingArguments)
SAMPLERS = ("random", "sequential", "group_by_length", "batch_rebalance")
GLOBAL_BATCH, MICRO, ROWS, EPOCHS = 8, 4, 48, 2
LAUNCH_ENV = dict(os.environ)


def rows(vocab: int) -> Dataset:
    """``ROWS`` rows of 3 to 30 tokens, lengths drawn independently of the tokens."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 31, (ROWS,), generator=g).tolist()
    ids = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]
    return Dataset.from_list([{"input_ids": x, "labels": x} for x in ids])


def segment(sampler: str, accumulation: int, model_dir: str, out_dir: str) -> dict:
    print(f"segment {sampler}", flush=True)
    args = hf_ext.TrainingArguments(
        output_dir=os.path.join(out_dir, sampler), num_train_epochs=EPOCHS, seed=0, save_strategy="no",
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=accumulation, learning_rate=1e-3,
        lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0, logging_steps=1, report_to=[],
        disable_tqdm=True, padding_free=True, train_sampling_strategy=sampler,
        include_num_input_tokens_seen="non_padding",
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = hf_ext.Trainer(model=model, args=args, train_dataset=rows(model.config.vocab_size))
    trainer.train()
    history = [e for e in trainer.state.log_history if "loss" in e]
    result = {
        "sampler": sampler, "world_size": args.world_size, "accumulation": args.gradient_accumulation_steps,
        "sampler_class": type(trainer._get_train_sampler()).__name__,
        "losses": [e["loss"] for e in history], "grad_norms": [e["grad_norm"] for e in history],
        "tokens_seen": [e["num_input_tokens_seen"] for e in history],
    }  # fmt: skip
    drop_trainer([trainer])
    restore_environment(LAUNCH_ENV)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--accum", type=int, required=True)
    opts = parser.parse_args()
    publish([segment(s, opts.accum, opts.model, os.path.dirname(opts.out)) for s in SAMPLERS], opts.out)


if __name__ == "__main__":
    main()
