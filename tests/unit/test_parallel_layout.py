"""Ranks grouped by tensor, sequence and context parallelism: what hf-ext fills, checks and plans with a DeepSpeed
AutoTP config or accelerate's ``ParallelismConfig`` (hf_ext.batching.Layout).

Two numbers, two oracles:

* the rows each optimizer step trains on: stock's own arithmetic, ``transformers.Trainer.get_total_train_batch_size``
  (data-parallel ranks = world / (tp x sp x cp)) and the size getters it calls, run on a trainer's attributes for a
  world size this process cannot have (4 or 8 ranks): those methods read the model, the DeepSpeed config and the
  accelerator's ``parallelism_config`` only, so the stock code runs unchanged on an object holding them;
* DeepSpeed's ``train_batch_size``: what DeepSpeed's batch check asserts, which counts the tensor-parallel ranks (it
  parses the config before AutoTP forms its groups; a real 2-rank AutoTP run, tests/distributed/test_parallel_layouts.py,
  fails with anything else) and not the sequence-parallel ones (the Ulysses unit accelerate passes it divides the
  world by them: ``deepspeed.runtime.config.DeepSpeedConfig`` with an ``mpu`` that has no data-parallel size).
"""

from __future__ import annotations

import types

import pytest
import transformers
from accelerate.parallelism_config import ParallelismConfig

from hf_ext.deepspeed.resolve import Hardware, explain_deepspeed_config

from ..ds_support import make_args

CPU = Hardware("cpu", fp16=False, bf16=True)
AUTO_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 1}}  # fmt: skip


def stock_total(config: dict, parallelism: ParallelismConfig | None, world: int, micro: int, accum: int) -> int:
    """``Trainer.get_total_train_batch_size`` (transformers' code) for a trainer with this DeepSpeed config and
    parallelism config on ``world`` ranks."""
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(), is_deepspeed_enabled=True, _train_batch_size=micro,
        args=types.SimpleNamespace(hf_deepspeed_config=types.SimpleNamespace(config=config)),
        accelerator=types.SimpleNamespace(parallelism_config=parallelism),
    )  # fmt: skip
    for name in ("get_tp_size", "get_sp_size", "get_cp_size"):
        setattr(trainer, name, types.MethodType(getattr(transformers.Trainer, name), trainer))
    args = types.SimpleNamespace(world_size=world, gradient_accumulation_steps=accum)
    return transformers.Trainer.get_total_train_batch_size(trainer, args)


LAYOUTS = {
    # name: (DeepSpeed config additions, ParallelismConfig kwargs, world size, the ranks DeepSpeed's check counts)
    "autotp-2-of-4": ({"tensor_parallel": {"autotp_size": 2}}, None, 4, 4),
    "ulysses-2-of-4": ({}, {"sp_size": 2, "sp_backend": "deepspeed"}, 4, 2),
    "autotp-2-ulysses-2-of-8": ({"tensor_parallel": {"autotp_size": 2}}, {"sp_size": 2, "sp_backend": "deepspeed"}, 8,
                                4),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_batch_keys_count_the_ranks_deepspeed_counts_and_a_step_the_data_parallel_ones(name, tmp_path):
    from hf_ext.batching import layout_of

    extra, parallelism, world, deepspeed_ranks = LAYOUTS[name]
    parallelism = ParallelismConfig(**parallelism) if parallelism else None
    config = {**AUTO_BATCH, **extra}
    args = make_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    args.parallelism_config = parallelism
    resolved = explain_deepspeed_config(config, args, None, world, defer=True, hardware=CPU).config
    assert resolved["train_batch_size"] == deepspeed_ranks * 2 * 3
    # the rows of one optimizer step: stock's arithmetic
    layout = layout_of(world, config, parallelism)
    assert layout.dp * 2 * 3 == stock_total(config, parallelism, world, 2, 3) < world * 2 * 3


def test_the_autotp_example_fills_what_deepspeed_checks(tmp_path, capsys):
    """``hf-ext ds resolve`` of an AutoTP config on 4 ranks, micro-batch 2, accumulation 3: DeepSpeed's check counts
    the 4 ranks (24), while a step trains on the rows of 2 data-parallel ranks (12, stock's arithmetic)."""
    import json

    from hf_ext.cli import main

    path = tmp_path / "tp.json"
    path.write_text('{"tensor_parallel": {"autotp_size": 2}, "train_batch_size": "auto"}')
    assert main(["ds", "resolve", str(path), "--world_size", "4", "--per_device_train_batch_size", "2",
                 "--gradient_accumulation_steps", "3", "--output_dir", str(tmp_path)]) == 0  # fmt: skip
    resolved = json.loads(capsys.readouterr().out.split("\n\n")[0])
    assert resolved["train_batch_size"] == 24 and stock_total(resolved, None, 4, 2, 3) == 12


def test_an_explicit_batch_is_checked_against_the_ranks_deepspeed_counts(tmp_path):
    config = {**AUTO_BATCH, "train_batch_size": 24}
    args = make_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    args.parallelism_config = ParallelismConfig(sp_size=2, sp_backend="deepspeed")
    res = explain_deepspeed_config(config, args, None, 4, defer=True, hardware=CPU, raise_errors=False)
    (problem,) = res.problems
    assert problem.key == "train_batch_size"
    assert (
        "2 data-parallel ranks (4 ranks / sequence-parallel 2) x micro-batch 2 x accumulation 3 = 12"
        in problem.message
    )
    fixed = make_args(tmp_path, **problem.args_fix)  # the fix the line gives works
    fixed.parallelism_config = args.parallelism_config
    assert explain_deepspeed_config(config, fixed, None, 4, defer=True, hardware=CPU).config["train_batch_size"] == 24


def test_a_size_that_does_not_divide_the_ranks_is_warned_about(tmp_path):
    # a warning, not a refusal: configs are resolved where they will not run too (hf-ext ds doctor: 1 rank by default)
    config = {**AUTO_BATCH, "tensor_parallel": {"autotp_size": 3}}
    res = explain_deepspeed_config(config, make_args(tmp_path), None, 4, defer=True, hardware=CPU)
    assert [w for w in res.warnings if "4 ranks cannot be divided" in w and "multiple of 3 ranks" in w]


def test_the_planner_counts_data_parallel_ranks(tiny_model_dir, tmp_path):
    config = {**AUTO_BATCH, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": "auto"}}
    args = make_args(tmp_path, memory_per_device="64GB", plan_seq_len=16)
    res = explain_deepspeed_config(config, args, str(tiny_model_dir), 4, defer=True, hardware=CPU)
    assert res.memory_plan.world_size == 2


@pytest.mark.parametrize("parallelism", [{"sp_size": 2, "sp_backend": "deepspeed"}, {"cp_size": 2}])
def test_padding_free_with_a_split_sequence_is_refused_in_one_line(parallelism, tmp_path):
    import hf_ext

    with pytest.raises(ValueError, match=r"padding_free=True with (sequence|context) parallelism") as err:
        hf_ext.TrainingArguments(str(tmp_path), padding_free=True, parallelism_config=ParallelismConfig(**parallelism),
                                 report_to=[])  # fmt: skip
    assert "\n" not in str(err.value) and "Fix: padding_free=False" in str(err.value)
