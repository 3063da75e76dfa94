"""Train the tiny BlenderBot a few steps on 2 ranks, save it twice and exit: the launch ``bench_exit`` repeats to count
ranks that abort at interpreter exit.

    deepspeed --num_gpus 2 --module benchmarks.exit_worker --model DIR --out DIR --variant hf-ext \\
        --deepspeed hf_ext/deepspeed/presets/zero3.json
    torchrun --nproc_per_node 2 -m benchmarks.exit_worker --model DIR --out DIR --variant stock --fsdp full_shard
    accelerate launch --config_file recipes/accelerate/zero3.yaml -m benchmarks.exit_worker --model DIR --out DIR \\
        --variant previous

``--variant``:

* ``hf-ext``: ``hf_ext.Seq2SeqTrainer`` trains, ``save_model()`` into ``--out``, then the stock
  ``transformers.Seq2SeqTrainer.save_model(trainer, OUT/stock_save)`` on the same trainer, then
  ``hf_ext.end_distributed()``;
* ``previous``: the same run, ended by what ``end_distributed`` did before it tore down DeepSpeed's engines and comm
  layer: ``release_deepspeed_shm_names(); dist.barrier(); dist.destroy_process_group()``;
* ``stock``: ``transformers.Seq2SeqTrainer`` (``use_cpu=True``, as a CPU user must pass) with the same DeepSpeed
  config or ``fsdp`` value, trains, ``save_model()`` then ``save_model(OUT/stock_save)``, and ends as transformers'
  example scripts do (``run_translation.py``'s ``main`` returns): no teardown at all. On CPU it starts DeepSpeed's
  comm itself (``deepspeed.init_distributed``) before the model loads, as a CPU user of stock must: stock starts
  torch.distributed only, and ``zero.Init`` would see a world of one rank. No hf-ext code runs in it but the
  synthetic rows and the name of DeepSpeed's ``/dev/shm`` workspace, which each rank writes to ``OUT/shm.rank<N>``
  for the bench to remove (stock leaves it behind).

Under ``accelerate launch`` pass neither ``--deepspeed`` nor ``--fsdp``: the launcher's YAML gives the engine. Each
rank writes ``OUT/exit.rank<N>.json`` after its teardown (its last statement before the interpreter exits): the
engine it ran, the seconds from the start of training to the end of the saves and to the end of the teardown, and the
wall-clock time of that last statement (the bench times the interpreter's exit from it). A
launch that aborted although both ranks wrote theirs died in interpreter finalization.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.tensor
import transformers
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, default_data_collator

from benchmarks.bench_exit import VARIANTS
from benchmarks.harness import synthetic_dataset


def engine_of(trainer) -> dict:
    wrapped = trainer.model_wrapped
    stage = getattr(wrapped, "zero_optimization_stage", None)
    return {
        "engine": type(wrapped).__name__,
        "zero_stage": stage() if callable(stage) else None,
        "dtensor_params": sum(isinstance(p, torch.distributed.tensor.DTensor) for p in trainer.model.parameters()),
        "world_size": trainer.args.world_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON config (both variants read the same file)")
    parser.add_argument("--fsdp", default=None, help="an fsdp value, e.g. full_shard")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()

    common = dict(
        output_dir=opts.out, deepspeed=opts.deepspeed, fsdp=opts.fsdp, max_steps=opts.steps,
        per_device_train_batch_size=2, learning_rate=1e-3, save_strategy="no", logging_steps=1, report_to=[],
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    if opts.variant == "stock":
        args = transformers.Seq2SeqTrainingArguments(use_cpu=not torch.cuda.is_available(), **common)
        trainer_class = transformers.Seq2SeqTrainer
        if args.deepspeed and dist.is_initialized():  # on CPU stock starts torch.distributed, not DeepSpeed's comm
            import deepspeed

            deepspeed.init_distributed(dist_backend=dist.get_backend())
    else:
        import hf_ext

        args = hf_ext.Seq2SeqTrainingArguments(**common)
        trainer_class = hf_ext.Seq2SeqTrainer
    from hf_ext.runtime import _deepspeed_shm_path  # where DeepSpeed's CPU comm puts this rank's workspace

    (Path(opts.out) / f"shm.rank{args.process_index}").write_text(f"{_deepspeed_shm_path(args.process_index)}\n")
    transformers.set_seed(0)
    model = AutoModelForSeq2SeqLM.from_pretrained(opts.model)  # after the arguments: ZeRO-3 loads it partitioned
    rows = synthetic_dataset(2 * args.world_size * opts.steps, model.config.vocab_size, seq_len=12)
    trainer = trainer_class(
        model=model, args=args, train_dataset=rows, data_collator=default_data_collator,
        processing_class=AutoTokenizer.from_pretrained(opts.model),
    )  # fmt: skip
    started = time.perf_counter()
    trainer.train()
    trainer.save_model()
    transformers.Seq2SeqTrainer.save_model(trainer, str(Path(opts.out) / "stock_save"))  # stock's save, any variant
    saved = time.perf_counter() - started
    result = {"rank": args.process_index, "variant": opts.variant, **engine_of(trainer)}

    if opts.variant == "hf-ext":
        import hf_ext

        hf_ext.end_distributed()
    elif opts.variant == "previous":
        from hf_ext.runtime import release_deepspeed_shm_names

        release_deepspeed_shm_names()
        dist.barrier()
        dist.destroy_process_group()
    # finished_at: the wall clock at the rank's last statement, for the seconds its interpreter then takes to exit
    result.update(saved_seconds=saved, torn_down_seconds=time.perf_counter() - started, finished_at=time.time())
    (Path(opts.out) / f"exit.rank{result['rank']}.json").write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
