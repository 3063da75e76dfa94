"""Saving benchmark: stock ``Trainer.save_model`` vs hf-ext's streaming save, and LoRA checkpoints stock vs hf-ext.

    python -m benchmarks.bench_save --size 400m --max_shard_size 200MB --out runs/bench/save_400m.json

Builds a random-init BlenderBot of the given shape (chat_e.models), then runs two 2-rank ZeRO-3 jobs under
``deepspeed --num_gpus 2`` (one optimizer step each, so the engine exists):

* full model: rank-0 peak extra RSS (sampled every 2 ms above the RSS before the call) and wall time of hf-ext's
  ``save_model`` and of the stock ``transformers.Trainer.save_model`` on the same trainer — hf-ext first, so that
  memory the stock call keeps in the allocator cannot inflate hf-ext's number;
* LoRA (r=8 on q/v): bytes and wall time of a checkpoint written by the stock ``Trainer._save_checkpoint`` and by
  hf-ext's.

Prints a Markdown table and writes the numbers as JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import types
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_save"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def worker(opts) -> None:
    from transformers import BlenderbotForConditionalGeneration, default_data_collator

    import hf_ext
    from hf_ext.deepspeed.resolve import load_deepspeed_config

    config = load_deepspeed_config("zero3")
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    args = hf_ext.Seq2SeqTrainingArguments(
        output_dir=opts.workdir,
        per_device_train_batch_size=1,
        max_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed=config,
        disable_tqdm=True,
        save_max_shard_size=opts.max_shard_size,
    )
    model = BlenderbotForConditionalGeneration.from_pretrained(opts.model)
    if opts.mode == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    data = [{"input_ids": [5] * 8, "attention_mask": [1] * 8, "labels": [6] * 4 + [2]}] * 2
    trainer = hf_ext.Seq2SeqTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    work = Path(opts.workdir)
    result = {}
    if opts.mode == "full":  # measure as soon as the engine exists: no Adam state, so the 400M shape fits in RAM
        trainer.add_callback(_MeasureAtTrainBegin(lambda: measure_full(trainer, args, work, result)))
        try:
            trainer.train()
        except _Measured:
            pass
    else:
        trainer.train()
        measure_lora(trainer, args, work, result)
    if args.process_index == 0:
        harness.write_json(opts.result, result)
    hf_ext.end_distributed()


class _Measured(Exception):
    pass


class _MeasureAtTrainBegin:
    def __init__(self, measure):
        self.measure = measure

    def __getattr__(self, name):
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, *args, **kwargs):
        self.measure()
        raise _Measured


def timed(trainer, args, result, name, fn, out):
    trainer.accelerator.wait_for_everyone()
    with harness.PeakRSS() as rss:
        start = time.perf_counter()
        fn(out)
        trainer.accelerator.wait_for_everyone()
        seconds = time.perf_counter() - start
    result[name] = {"seconds": round(seconds, 3), "rank0_extra_rss_bytes": rss.extra}
    if args.process_index == 0:
        result[name]["bytes"] = dir_bytes(out)


def measure_full(trainer, args, work, result):
    import torch
    import transformers

    timed(trainer, args, result, "hf_ext_save_model", trainer.save_model, work / "hf_ext")
    gc.collect()
    stock = lambda out: transformers.Seq2SeqTrainer.save_model(trainer, str(out))  # noqa: E731
    timed(trainer, args, result, "stock_save_model", stock, work / "stock")
    if args.process_index == 0:
        shards = sorted((work / "hf_ext").glob("model*.safetensors"))
        result["largest_shard_bytes"] = max(p.stat().st_size for p in shards)
        result["shards"] = len(shards)
        result["parameters"] = sum(
            int(torch.tensor(getattr(p, "ds_shape", p.shape)).prod()) for p in trainer.model.parameters()
        )


def measure_lora(trainer, args, work, result):
    import transformers

    step = trainer.state.global_step

    def checkpoint(save, out):
        trainer.args.output_dir = str(out)
        save(trainer.model_wrapped, None)
        return out / f"checkpoint-{step}"

    timed(
        trainer,
        args,
        result,
        "hf_ext_lora_checkpoint",
        lambda out: checkpoint(trainer._save_checkpoint, out),
        work / "lora_hf_ext",
    )
    # the stock checkpoint, with the stock save_model inside it
    trainer.save_model = types.MethodType(transformers.Seq2SeqTrainer.save_model, trainer)
    stock = lambda out: checkpoint(lambda m, t: transformers.Trainer._save_checkpoint(trainer, m, t), out)  # noqa: E731
    timed(trainer, args, result, "stock_lora_checkpoint", stock, work / "lora_stock")


def launch(model: Path, mode: str, workdir: Path, max_shard_size: str) -> dict:
    """One 2-rank ZeRO-3 launch of this module's worker side; rank 0's measurements."""
    result = workdir / f"{mode}.json"
    cmd = harness.launcher_cmd("deepspeed", MODULE) + ["--worker", "--mode", mode, "--model", str(model)]
    cmd += ["--workdir", str(workdir / mode), "--result", str(result), "--max_shard_size", max_shard_size]
    log = workdir / f"{mode}.log"
    if harness.run(cmd, log):
        raise SystemExit(f"{mode} save launch failed (see {log}):\n{log.read_text()[-3000:]}")
    return json.loads(result.read_text())


def table(full: dict, lora: dict) -> str:
    mib = 2**20
    ours, stock = full["hf_ext_save_model"], full["stock_save_model"]
    rows = [
        "| save | rank-0 peak extra RSS | wall time | output |",
        "|---|---|---|---|",
        f"| stock `Trainer.save_model` | {stock['rank0_extra_rss_bytes'] / mib:.0f} MiB | {stock['seconds']:.1f} s "
        f"| {stock['bytes'] / mib:.0f} MiB |",
        f"| hf-ext streaming save | {ours['rank0_extra_rss_bytes'] / mib:.0f} MiB "
        f"({ours['rank0_extra_rss_bytes'] / full['largest_shard_bytes']:.2f} × largest shard of "
        f"{full['largest_shard_bytes'] / mib:.0f} MiB) | {ours['seconds']:.1f} s | {ours['bytes'] / mib:.0f} MiB in "
        f"{full['shards']} shards |",
        f"| stock LoRA checkpoint | | {lora['stock_lora_checkpoint']['seconds']:.1f} s "
        f"| {lora['stock_lora_checkpoint']['bytes'] / mib:.1f} MiB |",
        f"| hf-ext LoRA checkpoint | | {lora['hf_ext_lora_checkpoint']['seconds']:.1f} s "
        f"| {lora['hf_ext_lora_checkpoint']['bytes'] / mib:.1f} MiB |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="400m", help="model shape from chat_e.models.SIZES")
    parser.add_argument("--max_shard_size", default="200MB")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: runs/bench_save)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.worker:
        return worker(opts)

    workdir = Path(opts.workdir or harness.ROOT / "runs" / "bench_save")
    workdir.mkdir(parents=True, exist_ok=True)
    model = harness.ensure_model(opts.size, workdir / f"model-{opts.size}")
    full = launch(model, "full", workdir, opts.max_shard_size)
    lora = launch(model, "lora", workdir, opts.max_shard_size)
    report = {"command": harness.command(MODULE, argv), "size": opts.size, "world_size": 2, "zero_stage": 3}
    report.update(max_shard_size=opts.max_shard_size, host=harness.host_info(), full=full, lora=lora)
    print(table(full, lora))
    if opts.out:
        harness.write_json(opts.out, report)
    return report


if __name__ == "__main__":
    main()
