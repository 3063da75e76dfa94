"""hf-ext's settings are real TrainingArguments fields (command line, YAML, Python), and building the arguments has
no process-wide side effect beyond the distributed start-up stock does itself."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import BlenderbotForConditionalGeneration, Trainer

from hf_ext import Seq2SeqTrainingArguments, TrainingArguments, runtime
from hf_ext.config_args import parse_args_with_config
from hf_ext.saving import zero

HF_EXT_FIELDS = {
    "memory_per_device", "plan_model", "plan_seq_len", "release_freed_memory", "save_max_shard_size",
    "save_gather_size",
}  # fmt: skip
GENERATION_EVAL_FIELDS = {
    "generation_eval", "generation_min_length", "generation_no_repeat_ngram_size", "generation_batch_size",
    "generation_bucket_by_length", "log_samples", "save_generations",
}  # fmt: skip


def test_every_hf_ext_setting_is_a_documented_field():
    for cls, names in (
        (TrainingArguments, HF_EXT_FIELDS),
        (Seq2SeqTrainingArguments, HF_EXT_FIELDS | GENERATION_EVAL_FIELDS),
    ):
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        assert names <= set(fields), names - set(fields)
        for name in names:
            assert fields[name].metadata.get("help"), name
            assert name in cls.__doc__, name


def test_save_max_shard_size_from_the_command_line_and_a_yaml(tmp_path):
    (args,) = parse_args_with_config(
        [Seq2SeqTrainingArguments], ["--output_dir", str(tmp_path), "--save_max_shard_size", "200MB"]
    )
    assert args.save_max_shard_size == "200MB"
    config = tmp_path / "run.yaml"
    config.write_text(f"output_dir: {tmp_path}\nsave_max_shard_size: 20KB\nsave_gather_size: 1MiB\n")
    (args,) = parse_args_with_config([Seq2SeqTrainingArguments], ["--config", str(config)])
    assert (args.save_max_shard_size, args.save_gather_size) == ("20KB", "1MiB")
    (args,) = parse_args_with_config(
        [Seq2SeqTrainingArguments], ["--config", str(config), "--save_max_shard_size", "1GB"]
    )
    assert args.save_max_shard_size == "1GB"  # the command line wins over the YAML


def test_a_bad_size_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="save_max_shard_size.*200MB, 5GB or 8GiB"):
        TrainingArguments(output_dir=str(tmp_path), save_max_shard_size="lots")


def test_save_model_follows_save_max_shard_size(tiny_model_dir, tmp_path):
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    args = TrainingArguments(output_dir=str(tmp_path), save_max_shard_size="100KB", report_to="none")
    trainer = Trainer(model=model, args=args)
    zero.save_trainer_model(trainer, tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    sizes = [(tmp_path / "saved" / name).stat().st_size for name in shards]
    # each shard holds at most 100 kB of tensor data (plus its JSON header), except a single larger tensor alone
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert all(size <= max(100_000, largest) + 16_384 for size in sizes), sizes
    # the shards hold every tensor of the model, equal to it: each state-dict key is saved, or is tied to (shares the
    # storage of) a saved one, which save_pretrained writes once
    expected = model.state_dict()
    saved = {k: v for name in shards for k, v in load_file(tmp_path / "saved" / name).items()}
    assert saved.keys() == index["weight_map"].keys()
    assert saved.keys() <= expected.keys(), sorted(saved.keys() - expected.keys())
    storages = {expected[k].untyped_storage().data_ptr() for k in saved}
    unsaved = [k for k in expected if k not in saved and expected[k].untyped_storage().data_ptr() not in storages]
    assert not unsaved, unsaved
    assert [k for k in saved if not torch.equal(saved[k], expected[k])] == []
    # and reloading gives back the same state dict, key for key
    reloaded = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "saved").state_dict()
    assert reloaded.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(reloaded[k], expected[k])] == []


def test_building_arguments_leaves_the_process_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "_RUN_SETUP", None)
    threads, env = torch.get_num_threads(), dict(os.environ)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), deepspeed="zero2", report_to="none")
    assert args.deepspeed_resolution is not None and args.deepspeed["zero_optimization"]["stage"] == 2
    assert torch.get_num_threads() == threads
    assert dict(os.environ) == env
    assert runtime._RUN_SETUP is None  # threads, malloc and shared memory wait for train start
    assert "deepspeed_resolution" not in args.to_dict()  # declared, but not a setting


def _counting(monkeypatch, module, name):
    """Replace ``module.name`` by a wrapper that counts its calls (and still runs it)."""
    real, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _no_collectives(monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective or process group was started while building TrainingArguments")

    for name in (
        "init_process_group",
        "barrier",
        "all_reduce",
        "broadcast",
        "all_gather_object",
        "broadcast_object_list",
    ):
        monkeypatch.setattr(dist, name, refuse)


def test_auto_arguments_built_twice_probe_the_model_once(tiny_model_dir, tmp_path, monkeypatch, no_global_deepspeed_config):  # fmt: skip
    from hf_ext.memory import auto

    monkeypatch.setattr(auto, "_MEASURED", {})
    probes = _counting(monkeypatch, auto, "measure")
    _no_collectives(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    built = [
        TrainingArguments(output_dir=str(tmp_path), deepspeed="auto", per_device_train_batch_size="auto",
                          plan_model=str(tiny_model_dir), plan_seq_len=16, memory_per_device="4GB", report_to="none")
        for _ in range(2)
    ]  # fmt: skip
    assert len(probes) == 1
    assert built[0].deepspeed == built[1].deepspeed and built[0].memory_plan is not None
    assert built[0].per_device_train_batch_size == built[0].deepspeed["train_micro_batch_size_per_gpu"] >= 1
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.parametrize("args_deepspeed", [None, "zero2"])
def test_the_trainer_deepspeed_keyword_resolves_once(args_deepspeed, tiny_model_dir, tmp_path, monkeypatch, no_global_deepspeed_config):  # fmt: skip
    from accelerate.state import AcceleratorState
    from transformers import BlenderbotForConditionalGeneration

    from hf_ext import Trainer
    from hf_ext import training_args as module

    resolutions = _counting(monkeypatch, module, "explain_deepspeed_config")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # the trainer's accelerator sets it: undone afterwards
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=args_deepspeed, report_to="none")
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    try:
        trainer = Trainer(model=model, args=args, deepspeed="zero2")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # the next test's accelerator starts afresh
    assert len(resolutions) == 1
    assert trainer.args.deepspeed["zero_optimization"]["stage"] == 2
    assert (trainer.args is args) == (args_deepspeed == "zero2")  # the same config: the arguments are kept
