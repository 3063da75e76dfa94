"""One 2-rank training run of the padding-free benchmark (benchmarks.bench_packing): the dialogue recipe's real rows
(its data pipeline, the demo's settings), one path.

    deepspeed --num_gpus 2 --module benchmarks.packing_worker --model runs/models/smollm2 --lora --path hf-ext \
        --config zero2.json --out OUT

``--path stock``: ``transformers.Trainer`` with ``DataCollatorForSeq2Seq`` (each micro-batch padded to its longest
row) and its random sampler, as the recipe trained before padding-free. ``--path hf-ext``: ``hf_ext.Trainer`` with
``padding_free=True`` and ``train_sampling_strategy="batch_rebalance"``. ``--path trl``: TRL's
``SFTTrainer(padding_free=True)`` on the same tokenized rows (its collator takes their labels as they are; bf16 and
activation checkpointing, on by default in TRL's config, off as on the other paths).

Each rank writes ``OUT.rank<N>.json``: the end time of each optimizer step and the real tokens trained on by then
(the Trainer's own count: ``include_num_input_tokens_seen="non_padding"``, the attention mask of a padded batch;
every token of a packed one), the peak resident memory above the level before the model loaded, and the eval loss on
the validation rows after training.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

import hf_ext
from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.memory.measure import current_rss, peak_rss, reset_peak_rss
from hf_ext.runtime import end_distributed, start_deepspeed_comm


class TokenClock(transformers.TrainerCallback):
    """The time and the real tokens seen at the end of every optimizer step."""

    def __init__(self):
        self.steps: list[tuple[float, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((time.perf_counter(), state.num_input_tokens_seen))


def dialogue_rows(tokenizer, opts):
    data_args = DataArguments(dataset_name="chitchat+chatterbot", n_train=opts.n_train, n_val=opts.n_val,
                              max_source_length=96, max_target_length=32)  # fmt: skip
    raw = load_dialogue_dataset(data_args)
    return (tokenize_dataset(raw["train"], tokenizer, data_args, family="causal"),
            tokenize_dataset(raw["validation"], tokenizer, data_args, family="causal"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", choices=["stock", "hf-ext", "trl"], required=True)
    parser.add_argument("--config", required=True, help="DeepSpeed JSON, given as is to every path")
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on every projection, as the demo")
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--n_train", type=int, default=160)
    parser.add_argument("--n_val", type=int, default=48)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()

    common = dict(
        output_dir=opts.out + ".run", per_device_train_batch_size=opts.batch, per_device_eval_batch_size=8,
        num_train_epochs=opts.epochs, learning_rate=opts.learning_rate, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, save_strategy="no", report_to=[], seed=42, disable_tqdm=True, bf16=False,
        include_num_input_tokens_seen="non_padding", deepspeed=load_deepspeed_config(opts.config),
    )  # fmt: skip
    if opts.path == "hf-ext":
        args = hf_ext.TrainingArguments(**common, padding_free=True, train_sampling_strategy="batch_rebalance",
                                        release_freed_memory=False)  # fmt: skip
        trainer_class = hf_ext.Trainer
    elif opts.path == "trl":
        import trl

        # the rows are truncated already (max_length=None: TRL enforces no length on padding-free rows). Every token
        # of a packed batch is real: counted as "all", since "non_padding" would count the tokens unequal to the pad
        # id, missing every end-of-turn token (it doubles as the pad token)
        args = trl.SFTConfig(**{**common, "include_num_input_tokens_seen": "all"}, use_cpu=not torch.cuda.is_available(),
                             padding_free=True, max_length=None, gradient_checkpointing=False)  # fmt: skip
        trainer_class = trl.SFTTrainer
    else:
        args = transformers.TrainingArguments(**common, use_cpu=not torch.cuda.is_available())
        trainer_class = transformers.Trainer
    start_deepspeed_comm()  # on CPU stock's arguments start torch.distributed but not DeepSpeed's comm

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train, validation = dialogue_rows(tokenizer, opts)
    baseline = current_rss()
    reset_peak_rss()
    transformers.set_seed(42)
    model = AutoModelForCausalLM.from_pretrained(opts.model)
    if opts.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    clock = TokenClock()
    collator = None if opts.path == "trl" else DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=validation,
                            data_collator=collator, processing_class=tokenizer, callbacks=[clock])  # fmt: skip
    trainer.train()
    train_peak = peak_rss() - baseline
    eval_loss = trainer.evaluate()["eval_loss"]
    result = {
        "rank": args.process_index,
        "path": opts.path,
        "steps": [(t - clock.steps[0][0], tokens) for t, tokens in clock.steps],
        "global_batch": args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps,
        "train_rows": len(train),
        "peak_increment_bytes": train_peak,
        "eval_loss": eval_loss,
        "final_loss": next(e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e),
        "torch_threads": torch.get_num_threads(),
    }
    with open(f"{opts.out}.rank{args.process_index}.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
    end_distributed()  # every path: a process group left to interpreter exit can abort it (std::terminate)
