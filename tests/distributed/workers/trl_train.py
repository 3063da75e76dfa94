"""Train the tiny chat model with TRL's SFTTrainer or DPOTrainer, stock and hf-ext's, on the same rows, seed and
DeepSpeed config, and leave what the tests compare.

    torchrun --nproc_per_node 2 tests/distributed/workers/trl_train.py --trainer sft|dpo --stage 2|3 [--lora]
        --model DIR --out DIR [--resume CHECKPOINT]
    torchrun --nproc_per_node 2 tests/distributed/workers/trl_train.py --case NAME=sft:2:full --case ... \
        --model DIR --out DIR [--resume]

Without --resume, a case trains hf-ext's trainer first, then stock TRL, each for 4 steps of 2 rows per rank:
``stock.json`` / ``hf_ext.json`` hold the per-step losses and each run's torch threads, hf-ext's run writes
``checkpoint-2`` and its final save into ``hf_ext/``, and ``hf_ext.pt`` holds its gathered weights (rank 0). Stock TRL
gets the config hf-ext resolved (every model-dependent ``"auto"`` filled; the step-count keys stay ``"auto"`` for
transformers to fill, as it does). With --resume (one rank), hf-ext's trainer resumes that checkpoint and finishes the
4 steps: ``resumed.json`` and ``resumed.pt``. Each --case runs one after the other in the same launch, into
``OUT/NAME`` (the tests pay one launch for all cases, one for all resumes). With --engine fsdp (torchrun), hf-ext's
trainer with FSDP2 full shard; with --engine ddp, stock TRL with plain DDP: ``fsdp.*`` / ``ddp.*`` and the final saves
in those folders; ``--then_engines fsdp ddp`` runs those SFT runs after the cases, in the same launch. Dropout is off
so that runs on different world sizes compare within float tolerance.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
from pathlib import Path

import deepspeed
import torch
import trl
from datasets import Dataset
from peft import LoraConfig
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import hf_ext.trl
from benchmarks.worker import restore_environment  # as the benchmarks' segments
from tests.saving_support import gathered_state_dict

WORDS = "apple river cloud music garden winter coffee books train sunny dog guitar ocean movie paint soup".split()
STEPS, SAVE_AT, ROWS = 4, 2, 16
LAUNCH_ENV = dict(os.environ)


def rows(kind: str) -> Dataset:
    """16 conversational rows: a question about a word, a reply that names it (chosen) or does not (rejected)."""
    out = []
    for word in WORDS[:ROWS]:
        prompt = [{"role": "user", "content": f"What do you think about {word}?"}]
        chosen = [{"role": "assistant", "content": f"I really like {word}, it reminds me of home."}]
        rejected = [{"role": "assistant", "content": "No."}]
        if kind == "sft":
            out.append({"prompt": prompt, "completion": chosen})
        else:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return Dataset.from_list(out)


def common_args(opts, out: str, accum: int) -> dict:
    return dict(
        output_dir=out, report_to=[], seed=0, max_steps=STEPS, per_device_train_batch_size=2,
        gradient_accumulation_steps=accum, logging_steps=1, bf16=opts.bf16, learning_rate=1e-2 if opts.lora else 1e-3,
        save_strategy="steps", save_steps=SAVE_AT, disable_tqdm=True, max_length=64, activation_checkpointing=False,
        dataloader_drop_last=True, use_cpu=not torch.cuda.is_available(),  # stock on CPU ranks needs it said
    )  # fmt: skip


def build(opts, module, out: str, deepspeed, accum: int = 1, fsdp: str = ""):
    """The trainer of ``module`` (``trl`` or ``hf_ext.trl``) for ``opts.trainer``, with its own fresh model."""
    config_class = module.SFTConfig if opts.trainer == "sft" else module.DPOConfig
    trainer_class = module.SFTTrainer if opts.trainer == "sft" else module.DPOTrainer
    # hf-ext's trainers take the config by their own keyword, as a user writes Trainer(..., deepspeed="zero3")
    keyword = {"deepspeed": deepspeed} if module is hf_ext.trl else {}
    args = config_class(deepspeed=None if keyword else deepspeed, fsdp=fsdp, **common_args(opts, out, accum))
    model = AutoModelForCausalLM.from_pretrained(opts.model, attn_implementation="eager")
    peft_config = (
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]) if opts.lora else None
    )
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    return trainer_class(model=model, args=args, train_dataset=rows(opts.trainer), processing_class=tokenizer,
                         peft_config=peft_config, **keyword)  # fmt: skip


def losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def write(trainer, path: Path, extra: dict | None = None) -> None:
    state = gathered_state_dict(trainer.model)  # every rank takes part in the gather
    if trainer.args.process_index == 0:
        torch.save({k: v.float().cpu() for k, v in state.items()}, path.with_suffix(".pt"))
        info = {"losses": losses(trainer), "world_size": trainer.args.world_size, "threads": torch.get_num_threads(),
                **(extra or {})}  # fmt: skip
        path.with_suffix(".json").write_text(json.dumps(info, indent=1))


def release() -> None:
    unset_hf_deepspeed_config()
    gc.collect()


def run_case(opts, out: Path) -> None:
    """One case under DeepSpeed: hf-ext's trainer then stock TRL's (2 ranks), or hf-ext's resume (--resume)."""
    if opts.resume:
        # the 2-rank run's command line, on this world size: hf-ext keeps the global batch by itself
        trainer = build(opts, hf_ext.trl, str(out / "hf_ext"), f"zero{opts.stage}")
        trainer.train(resume_from_checkpoint=opts.resume)
        write(trainer, out / "resumed", {"accumulation": trainer.args.gradient_accumulation_steps})
        del trainer
        release()
        return

    hf = build(opts, hf_ext.trl, str(out / "hf_ext"), f"zero{opts.stage}")
    # the config the engines start from, every model-dependent "auto" filled (the step keys are filled at train start)
    resolved = copy.deepcopy(hf.accelerator.state.deepspeed_plugin.hf_ds_config.config)
    reference = getattr(hf, "ref_model", None)  # DPO: TRL's own engine for the reference model
    reference_config = reference.config if isinstance(reference, deepspeed.DeepSpeedEngine) else None
    hf.train()
    hf.save_model()
    write(hf, out / "hf_ext", {
        "resolved": resolved,
        "reference_engine_config": reference_config,
    })  # fmt: skip
    del hf, reference
    release()

    stock = build(opts, trl, str(out / "stock"), copy.deepcopy(resolved))
    stock.train()
    write(stock, out / "stock")
    del stock
    release()


def run_engine(opts, out: Path, engine: str) -> None:
    """One run without DeepSpeed: hf-ext's trainer under FSDP2 full shard (``fsdp``) or stock TRL's under DDP."""
    module = hf_ext.trl if engine == "fsdp" else trl
    trainer = build(opts, module, str(out / engine), None, fsdp="full_shard" if engine == "fsdp" else "")
    trainer.train()
    trainer.save_model()
    parameters = list(trainer.model_wrapped.parameters())
    write(trainer, out / engine, {"dtensors": sum(isinstance(p, DTensor) for p in parameters),
                                  "parameters": len(parameters)})  # fmt: skip
    del trainer
    release()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["sft", "dpo"], default="sft")
    parser.add_argument("--stage", type=int, choices=[2, 3], default=3)
    parser.add_argument(
        "--engine",
        choices=["deepspeed", "fsdp", "ddp"],
        default="deepspeed",
        help="fsdp: hf-ext's trainer with FSDP2 full shard; ddp: stock TRL with plain DDP (torchrun)",
    )
    parser.add_argument("--lora", action="store_true")
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        metavar="NAME=TRAINER:STAGE:full|lora",
        help="run these cases one after the other in this launch, each into OUT/NAME (instead of --trainer, "
        "--stage and --lora into OUT); with --resume, each resumes OUT/NAME/hf_ext/checkpoint-2",
    )
    parser.add_argument("--then_engines", nargs="*", default=[], choices=["fsdp", "ddp"],
                        help="after the cases (not with --resume): these SFT runs, as --engine runs them")  # fmt: skip
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (the GPU tier); fp32 otherwise")
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", nargs="?", const=True, default=None, help="CHECKPOINT (without --case)")
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()
    out = Path(opts.out)

    if opts.engine != "deepspeed":  # one run, under torchrun
        run_engine(opts, out, opts.engine)
        return

    if not opts.case:
        run_case(opts, out)
        return
    for case in opts.case:
        name, spec = case.split("=")
        trainer, stage, kind = spec.split(":")
        case_opts = argparse.Namespace(
            **{**vars(opts), "trainer": trainer, "stage": int(stage), "lora": kind == "lora"}
        )
        if opts.resume:
            case_opts.resume = str(out / name / "hf_ext" / f"checkpoint-{SAVE_AT}")
        run_case(case_opts, out / name)
    for engine in [] if opts.resume else opts.then_engines:
        restore_environment(LAUNCH_ENV)
        run_engine(argparse.Namespace(**{**vars(opts), "trainer": "sft", "lora": False}), out, engine)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
