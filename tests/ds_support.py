"""Checks shared by the DeepSpeed config tests of every tier: DeepSpeed's own parser, transformers' own glue, and
the one-line shape of hf-ext's problems."""

from __future__ import annotations

import copy

from hf_ext import DeepSpeedConfigError, TrainingArguments


def make_args(tmp_path, **kwargs) -> TrainingArguments:
    defaults = dict(output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=2, max_steps=10)
    return TrainingArguments(**{**defaults, **kwargs})


def deepspeed_accepts(config: dict, world_size: int):
    """DeepSpeed's own parser on the config, with the world size it will run at."""
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(config)
    probe.pop("train_batch_size")  # outside a process group DeepSpeed assumes world size 1...
    parsed = DeepSpeedConfig(probe)
    micro, accum = parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps
    assert config["train_batch_size"] == micro * accum * world_size  # ...so the batch product is checked here
    return parsed


def stock_mismatches(config: dict, args) -> list[str]:
    """What transformers' own DeepSpeed glue says about ``config`` with these arguments."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(config))
    hf.trainer_config_process(args)
    return hf.mismatches


def single_line_problems(err: DeepSpeedConfigError):
    assert err.problems
    for problem in err.problems:
        text = str(problem)
        assert "\n" not in text
        assert "validation error" not in text and "errors.pydantic.dev" not in text and "Traceback" not in text
