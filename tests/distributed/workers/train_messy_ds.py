"""Train a tiny BlenderBot for a few steps with ``hf_ext.Seq2SeqTrainer(deepspeed=<messy config>)``.

    deepspeed --num_gpus 2 tests/distributed/workers/train_messy_ds.py --model DIR --out DIR [--config messy|PRESET|FILE.json ...]

``--config messy`` (the default) is a dict written the way configs copied from blog posts look: the old
``bfloat16`` section, a deprecated gather flag, a ZeRO key at top level, a key with stray whitespace, string
booleans, float literals, and a top-level ``"gradient_checkpointing": true``; anything else is what ``deepspeed=``
accepts (a preset name, a JSON path). Writes the trained model and ``probe.json`` (what the tests check) into
``OUT/<config name>/``. Several configs train one after the other in the same processes, each from a fresh model.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from transformers import BlenderbotForConditionalGeneration, default_data_collator

import hf_ext
from benchmarks.worker import drop_trainer, restore_environment  # as the benchmarks' segments
from tests.saving_support import synthetic_rows  # the repository root is on PYTHONPATH under the tests' launchers

MESSY = {
    "bfloat16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        " overlap_comm": "true",
        "contiguous_gradients": "true",
        # a float literal, as blog posts write it. Their 1e9 spent ~90 s of this launch's 93 s starting the ZeRO-3
        # engine on CPU ranks; 1e6 tests the same normalization (1e9 -> int: tests/unit/test_deepspeed_config.py)
        "sub_group_size": 1e6,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_fp16_weights_on_model_save": True,
    },
    "stage3_max_live_parameters": 1e9,
    "gradient_checkpointing": True,
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": "false",
}


def train(config, out: Path, model_dir: str, steps: int, memory: str | None = None) -> None:
    args = hf_ext.Seq2SeqTrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        deepspeed=MESSY if config == "messy" else config,
        # the memory planner sizes the `auto` preset from the model (with this machine's memory)
        **(dict(plan_model=model_dir, plan_seq_len=12, memory_per_device=memory) if config == "auto" else {}),
    )  # fmt: skip
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
    forward_calls = [0]
    # Inside a decoder layer: activation checkpointing runs it again during backward (hooks on the layer itself stay
    # outside the checkpoint and fire once).
    layer = model.model.decoder.layers[0].fc1
    layer.register_forward_hook(lambda *_: forward_calls.__setitem__(0, forward_calls[0] + 1))
    trainer = hf_ext.Seq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=synthetic_rows(64, model.config.vocab_size),
        data_collator=default_data_collator,
    )
    result = trainer.train()
    trainer.save_model()
    engine = trainer.model_wrapped
    if trainer.is_world_process_zero():
        probe = {
            "global_step": trainer.state.global_step,
            "train_loss": result.training_loss,
            "losses": [row["loss"] for row in trainer.state.log_history if "loss" in row],
            "forward_calls_fc1": forward_calls[0],
            "activation_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
            "engine": type(engine).__name__,
            "zero_stage": engine.zero_optimization_stage(),
            "offload_optimizer": str(getattr(engine.zero_offload_optimizer(), "device", "none")),
            "offload_param": str(getattr(engine.zero_offload_param(), "device", "none")),
            "optimizer": type(engine.optimizer).__name__,
            "world_size": args.world_size,
            "hidden_size": model.config.hidden_size,
            "num_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
        }
        (out / "probe.json").write_text(json.dumps(probe, indent=2))
    del engine
    drop_trainer([trainer])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", nargs="+", default=["messy"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--memory_per_device", default=None, help="the budget of the `auto` preset")
    parser.add_argument("--local_rank", type=int, default=-1)  # set by the deepspeed launcher
    opts = parser.parse_args()
    launch_env = dict(os.environ)
    for config in opts.config:
        train(config, Path(opts.out) / Path(config).stem, opts.model, opts.steps, opts.memory_per_device)
        restore_environment(launch_env)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
