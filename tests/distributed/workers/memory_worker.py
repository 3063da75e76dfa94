"""Train a few steps the way a user would and record each rank's peak memory above its level before the model.

    deepspeed --num_gpus 2 tests/distributed/workers/memory_worker.py --model DIR --config zero3 --out PREFIX
    torchrun --nproc_per_node 2 tests/distributed/workers/memory_worker.py --model DIR --config ddp --out PREFIX

``--config`` is ``ddp`` (no DeepSpeed) or anything ``deepspeed=`` accepts (a preset name, ``auto``, a JSON path).
Each rank writes ``PREFIX.rank<N>.json``: the increment of its peak RSS over its RSS before the model existed, the
ZeRO stage and plan the run used, whether freed memory went back to the OS, and the last loss.
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers
from transformers import AutoModelForSeq2SeqLM, default_data_collator

import hf_ext
from hf_ext.memory.measure import current_rss, peak_rss, reset_peak_rss
from hf_ext.runtime import run_summary


def synthetic_dataset(n: int, vocab: int, seq_len: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(4, vocab, (seq_len,), generator=g).tolist(),
            "attention_mask": [1] * seq_len,
            "labels": torch.randint(4, vocab, (seq_len,), generator=g).tolist(),
        }
        for _ in range(n)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", default="zero2")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--memory_per_device", default=None)
    parser.add_argument("--release_freed_memory", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    opts = parser.parse_args()

    planned = opts.memory_per_device is not None or opts.config == "auto"
    args = hf_ext.TrainingArguments(
        output_dir=opts.out + ".run", per_device_train_batch_size=opts.batch, max_steps=opts.steps,
        learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
        deepspeed=None if opts.config == "ddp" else opts.config,
        release_freed_memory={"auto": None, "on": True, "off": False}[opts.release_freed_memory],
        **(dict(memory_per_device=opts.memory_per_device, plan_model=opts.model, plan_seq_len=opts.seq_len)
           if planned else {}),
    )  # fmt: skip
    hf_ext.prepare_run(args)  # as the recipe does: threads and malloc set before the model loads
    baseline = current_rss()
    reset_peak_rss()
    transformers.set_seed(0)
    model = AutoModelForSeq2SeqLM.from_pretrained(opts.model)
    rows = max(64, opts.batch * args.world_size * opts.steps)
    trainer = hf_ext.Trainer(
        model=model,
        args=args,
        train_dataset=synthetic_dataset(rows, model.config.vocab_size, opts.seq_len),
        data_collator=default_data_collator,
    )
    trainer.train()
    peak = peak_rss()
    summary = run_summary(trainer)
    zero = (getattr(getattr(args, "hf_deepspeed_config", None), "config", None) or {}).get("zero_optimization", {})
    result = {
        "rank": args.process_index,
        "world_size": summary["world_size"],
        "increment_bytes": peak - baseline,
        "zero_optimization": zero,  # the section the engine ran with (as hf-ext resolved it for this host)
        "zero_stage": zero.get("stage"),
        "offload_optimizer": zero.get("offload_optimizer"),
        "plan": args.memory_plan.to_dict() if args.memory_plan is not None else None,
        "released_freed_memory": summary["released_freed_memory"],
        "final_loss": next((e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e), None),
    }
    with open(f"{opts.out}.rank{args.process_index}.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
