"""One training run whose per-rank memory is measured (used by scripts/bench_memory.py and tests/test_planner.py).

    deepspeed --num_gpus 2 scripts/memory_worker.py --model DIR --config zero3 --out result.json
    torchrun --nproc_per_node 2 scripts/memory_worker.py --model DIR --config ddp --out result.json

``--config`` is ``ddp`` (plain DistributedDataParallel, no DeepSpeed) or anything hf-ext's ``deepspeed=`` accepts
(a preset name such as ``zero2`` / ``zero3_offload`` / ``auto``, a JSON path). ``--path stock`` builds stock
``transformers`` arguments and trainer (the preset JSON handed to them as is), ``--path hf-ext`` hf-ext's.

Each rank writes ``OUT.rank<N>.json``: its RSS before the model exists (``baseline_bytes``), the peak RSS from
there to the end of training (``peak_bytes``), the process's lifetime peak (``lifetime_peak_bytes``), and the
DeepSpeed config the engine ran with.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
import transformers
from transformers import AutoModelForSeq2SeqLM, default_data_collator

import hf_ext
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.memory.measure import MemoryPlanCallback, current_rss, peak_rss, reset_peak_rss


def synthetic_dataset(n: int, vocab: int, seq_len: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(4, vocab, (seq_len,), generator=g).tolist(),
            "attention_mask": [1] * seq_len,
            "labels": torch.randint(4, vocab, (seq_len,), generator=g).tolist(),
        }
        for _ in range(n)
    ]


class StepTimer(transformers.TrainerCallback):
    """When training began (engine built) and when each optimizer step ended, for steady-state throughput; with the
    process's CPU seconds (user, system) and minor page faults at each of those moments, to tell where time went."""

    def __init__(self):
        self.train_begin: float | None = None
        self.step_ends: list[float] = []
        self.step_usage: list[tuple[float, float, int]] = []

    def _usage(self):
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.step_usage.append((usage.ru_utime, usage.ru_stime, usage.ru_minflt))

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_begin = time.perf_counter()
        self._usage()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.perf_counter())
        self._usage()


class PhaseRecorder(transformers.TrainerCallback):
    """Peak RSS reached by the end of each phase (engine built, each step), for the breakdown in the results."""

    def __init__(self):
        self.phases: list[tuple[str, int, int]] = []

    def _mark(self, name):
        self.phases.append((name, peak_rss(), current_rss()))

    def on_train_begin(self, args, state, control, **kwargs):
        self._mark("engine_ready")

    def on_step_end(self, args, state, control, **kwargs):
        self._mark(f"step{state.global_step}")


def build_arguments(opts, path: str, output_dir: str):
    """TrainingArguments and Trainer class of ``path`` (stock or hf-ext) for ``opts``, with DeepSpeed's comm started;
    and the seconds that took (hf-ext resolves its DeepSpeed config and starts the comm inside TrainingArguments)."""
    batch = opts.batch if opts.batch == "auto" else int(opts.batch)
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        max_steps=opts.steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        activation_checkpointing=opts.activation_checkpointing,
    )
    deepspeed = None if opts.config == "ddp" else opts.config
    args_started = time.perf_counter()
    if path == "stock":
        if deepspeed is not None:
            deepspeed = load_deepspeed_config(deepspeed)  # the preset's JSON, "auto"s left to transformers
        args = transformers.TrainingArguments(use_cpu=not torch.cuda.is_available(), deepspeed=deepspeed, **common)
        trainer_class = transformers.Trainer
    else:
        extra = {}
        if opts.memory_per_device or "auto" in (opts.config, opts.batch):
            extra = {
                "memory_per_device": opts.memory_per_device,
                "plan_model": opts.model,
                "plan_seq_len": opts.seq_len,
            }
        extra["release_freed_memory"] = {"auto": None, "on": True, "off": False}[opts.release_freed_memory]
        args = hf_ext.TrainingArguments(deepspeed=deepspeed, **common, **extra)
        trainer_class = hf_ext.Trainer
    if deepspeed is not None:
        import deepspeed as ds

        ds.init_distributed(dist_backend="gloo" if args.device.type == "cpu" else None)
    return args, trainer_class, time.perf_counter() - args_started


def build_trainer(opts, args, trainer_class, *callbacks):
    """A ``trainer_class`` with ``callbacks`` on the seeded model from ``opts.model`` and synthetic rows; and the
    peak RSS once the model was loaded."""
    transformers.set_seed(0)
    model = AutoModelForSeq2SeqLM.from_pretrained(opts.model)
    after_load = peak_rss()
    # enough rows that every step gets full micro-batches on every rank (large micro-batches in bench_max_batch)
    rows = max(64, int(args.per_device_train_batch_size) * args.world_size * opts.steps)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=synthetic_dataset(rows, model.config.vocab_size, opts.seq_len),
        data_collator=default_data_collator,
    )
    for callback in callbacks:
        trainer.add_callback(callback)
    return trainer, after_load


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--config", default="zero2", help="ddp, or a DeepSpeed preset name / JSON path")
    parser.add_argument("--path", default="hf-ext", choices=["hf-ext", "stock"])
    parser.add_argument("--batch", default="2", help="per-device micro-batch, or auto")
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--memory_per_device", default=None)
    parser.add_argument(
        "--release_freed_memory", default="auto", choices=["auto", "on", "off"],
        help="hf-ext's TrainingArguments.release_freed_memory (auto: on when the planner plans the run)",
    )  # fmt: skip
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()

    args, trainer_class, args_seconds = build_arguments(opts, opts.path, opts.out + ".run")
    startup_peak, baseline = peak_rss(), current_rss()
    reset_peak_rss()

    phases, timer = PhaseRecorder(), StepTimer()
    trainer, after_load = build_trainer(opts, args, trainer_class, phases, timer)
    train_called = time.perf_counter()
    trainer.train()
    peak = peak_rss()
    # hf-ext's MemoryPlanCallback restarts the kernel's peak at train start; it keeps the peak reached before
    plan_callback = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MemoryPlanCallback)), None)
    if plan_callback is not None:
        peak = max(peak, plan_callback.peak_before_train)
    engine_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    plan = getattr(args, "hf_ext_memory_plan", None)
    result = {
        "rank": args.process_index,
        "world_size": args.world_size,
        "config": opts.config,
        "path": opts.path,
        "batch": args.per_device_train_batch_size,
        "seq_len": opts.seq_len,
        "activation_checkpointing": opts.activation_checkpointing,
        "baseline_bytes": baseline,
        "load_peak_bytes": after_load,
        "peak_bytes": peak,
        "increment_bytes": peak - baseline,
        "startup_peak_bytes": startup_peak,
        "phases": [(name, hwm - baseline, rss - baseline) for name, hwm, rss in phases.phases],
        "zero_stage": (engine_config or {}).get("zero_optimization", {}).get("stage"),
        "offload_optimizer": (engine_config or {}).get("zero_optimization", {}).get("offload_optimizer"),
        "plan": plan.to_dict() if plan is not None else None,
        "released_freed_memory": getattr(args, "hf_ext_released_freed_memory", False),
        "final_loss": next((e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e), None),
        "memory_log": [e for e in trainer.state.log_history if "memory_peak_gib" in e],
        "args_seconds": args_seconds,
        "engine_start_seconds": (timer.train_begin or train_called) - train_called,
        "step_end_times": [t - train_called for t in timer.step_ends],
        "step_usage": timer.step_usage,  # (user s, system s, minor faults) at train begin and after each step
        "global_batch": args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps,
    }
    with open(f"{opts.out}.rank{args.process_index}.json", "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
