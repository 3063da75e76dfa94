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
every token of a packed one), the peak resident memory above the level before the model loaded (and on a GPU the
peak allocated device memory above the level then), and the eval loss on the validation rows after training.

One GPU (benchmarks.bench_gpu): ``--paths stock hf-ext trl --config none --bf16`` trains the paths one after the
other in one process, without DeepSpeed, each writing ``OUT.<path>.rank0.json``; every run's model, trainer and
device memory are dropped before the next starts. ``PACKING_PROFILE=DIR`` profiles three steps of each path (an
untimed run: ``StepProfile``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq

import hf_ext
from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset
from hf_ext.atomic import write_text_atomically
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.memory.measure import current_rss, peak_rss, reset_peak_rss
from hf_ext.runtime import end_distributed, start_deepspeed_comm

PATHS = ("stock", "hf-ext", "trl")


class TokenClock(transformers.TrainerCallback):
    """The time and the real tokens seen at the end of every optimizer step."""

    def __init__(self):
        self.steps: list[tuple[float, int]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((time.perf_counter(), state.num_input_tokens_seen))


class StepProfile(transformers.TrainerCallback):
    """``PACKING_PROFILE=DIR``: ``torch.profiler`` over optimizer steps ``first`` to ``first + steps - 1`` of each
    path, its operators by self time on the device and on the host, and by host time with children, into ``DIR/<path>.txt``: where a path's
    step time goes. Off by default: the profiler slows the steps it records, so a timed run leaves it off."""

    def __init__(self, directory: str, path: str, first: int = 8, steps: int = 3):
        self.file, self.first, self.steps, self.profiler = Path(directory) / f"{path}.txt", first, steps, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.first and self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profiler is not None and state.global_step == self.first + self.steps:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            keys = ["self_cpu_time_total", "cpu_time_total"]  # a host-bound step (launches, syncs) shows here
            if torch.cuda.is_available():
                keys.insert(0, "self_cuda_time_total")
            averages = self.profiler.key_averages()
            tables = [f"steps {self.first}-{self.first + self.steps - 1}, sorted by {key}\n"
                      f"{averages.table(sort_by=key, row_limit=30)}\n" for key in keys]  # fmt: skip
            self.file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(self.file, "\n".join(tables))
            self.profiler = False


def dialogue_rows(tokenizer, opts):
    data_args = DataArguments(dataset_name="chitchat+chatterbot", n_train=opts.n_train, n_val=opts.n_val,
                              max_source_length=96, max_target_length=32)  # fmt: skip
    raw = load_dialogue_dataset(data_args)
    return (tokenize_dataset(raw["train"], tokenizer, data_args, family="causal"),
            tokenize_dataset(raw["validation"], tokenizer, data_args, family="causal"))  # fmt: skip


def training_arguments(opts, path: str):
    """``path``'s TrainingArguments and Trainer class for ``opts`` (the same settings on every path)."""
    common = dict(
        output_dir=f"{opts.out}.{path}.run", per_device_train_batch_size=opts.batch, per_device_eval_batch_size=8,
        num_train_epochs=opts.epochs, learning_rate=opts.learning_rate, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, save_strategy="no", report_to=[], seed=42, disable_tqdm=True, bf16=opts.bf16,
        include_num_input_tokens_seen="non_padding",
        deepspeed=None if opts.config == "none" else load_deepspeed_config(opts.config),
    )  # fmt: skip
    if path == "hf-ext":
        args = hf_ext.TrainingArguments(**common, padding_free=True, train_sampling_strategy="batch_rebalance",
                                        release_freed_memory=False)  # fmt: skip
        return args, hf_ext.Trainer
    if path == "trl":
        import trl

        # the rows are truncated already (max_length=None: TRL enforces no length on padding-free rows). Every token
        # of a packed batch is real: counted as "all", since "non_padding" would count the tokens unequal to the pad
        # id, missing every end-of-turn token (it doubles as the pad token)
        args = trl.SFTConfig(**{**common, "include_num_input_tokens_seen": "all"},
                             use_cpu=not torch.cuda.is_available(), padding_free=True, max_length=None,
                             gradient_checkpointing=False)  # fmt: skip
        return args, trl.SFTTrainer
    return transformers.TrainingArguments(**common, use_cpu=not torch.cuda.is_available()), transformers.Trainer


def train_path(opts, path: str, tokenizer, train, validation) -> dict:
    """One training run of ``path`` on ``train``, then the eval loss on ``validation``: the measurements (rank 0's
    are the run's); everything the run built is dropped before returning."""
    args, trainer_class = training_arguments(opts, path)
    start_deepspeed_comm()  # on CPU stock's arguments start torch.distributed but not DeepSpeed's comm
    cuda = torch.cuda.is_available()
    gc.collect()
    if cuda:  # the device's peak from here on, above what is allocated now
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    device_baseline = torch.cuda.memory_allocated() if cuda else None
    baseline = current_rss()
    reset_peak_rss()
    transformers.set_seed(42)
    model = AutoModelForCausalLM.from_pretrained(
        opts.model, **({"attn_implementation": opts.attn} if opts.attn else {})
    )
    if opts.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    clock = TokenClock()
    callbacks = [clock]
    if os.environ.get("PACKING_PROFILE"):
        callbacks.append(StepProfile(os.environ["PACKING_PROFILE"], path))
    collator = None if path == "trl" else DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=validation,
                            data_collator=collator, processing_class=tokenizer, callbacks=callbacks)  # fmt: skip
    trainer.train()
    train_peak = peak_rss() - baseline
    device_peak = torch.cuda.max_memory_allocated() - device_baseline if cuda else None
    eval_loss = trainer.evaluate()["eval_loss"]
    result = {
        "rank": args.process_index,
        "path": path,
        "steps": [(t - clock.steps[0][0], tokens) for t, tokens in clock.steps],
        "global_batch": args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps,
        "train_rows": len(train),
        "peak_increment_bytes": train_peak,
        "peak_device_increment_bytes": device_peak,
        "eval_loss": eval_loss,
        "final_loss": next(e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e),
        "torch_threads": torch.get_num_threads(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "bf16": bool(args.bf16),
        "device": str(args.device),
    }
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", choices=PATHS, help="the one path of this launch")
    parser.add_argument("--paths", nargs="+", choices=PATHS,
                        help="instead of --path: these paths one after the other in this process (no DeepSpeed: "
                        "--config none), each writing OUT.<path>.rank<N>.json")  # fmt: skip
    parser.add_argument(
        "--config", required=True, help="DeepSpeed JSON, given as is to every path; none: no DeepSpeed"
    )
    parser.add_argument("--lora", action="store_true", help="LoRA r=16 on every projection, as the demo")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision on every path")
    parser.add_argument(
        "--attn", default=None, help="attn_implementation of the model on every path (default: its own)"
    )
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--n_train", type=int, default=160)
    parser.add_argument("--n_val", type=int, default=48)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()
    if (opts.path is None) == (opts.paths is None):
        parser.error("give --path or --paths")
    if opts.paths and opts.config != "none":
        parser.error("--paths runs in one process: DeepSpeed engines are not torn down between paths (--config none)")

    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train, validation = dialogue_rows(tokenizer, opts)
    for path in opts.paths or [opts.path]:
        result = train_path(opts, path, tokenizer, train, validation)
        name = f"{opts.out}.{path}" if opts.paths else opts.out
        with open(f"{name}.rank{result['rank']}.json", "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
    end_distributed()  # every path: a process group left to interpreter exit can abort it (std::terminate)
