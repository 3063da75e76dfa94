"""DeepSpeed config resolution: stock parity, every normalization, every error path (the real-world corpus is in
test_deepspeed_corpus.py, 2-rank runs in tests/distributed/test_presets_distributed.py).

Real parts only: DeepSpeed's own config classes validate, transformers' own ``HfTrainerDeepSpeedConfig`` is the
parity reference.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import BlenderbotConfig, GPT2Config

from hf_ext import (
    PRESETS,
    DeepSpeedConfigError,
    explain_deepspeed_config,
    load_deepspeed_config,
    resolve_deepspeed_config,
)
from hf_ext.deepspeed.fill import get_value
from hf_ext.deepspeed.normalize import normalize
from hf_ext.deepspeed.resolve import Hardware, fill_model_keys
from hf_ext.memory.formulas import CPU_ZERO3_GRANULARITY, CPU_ZERO3_KEYS

from ..conftest import ROOT, walk
from ..ds_support import deepspeed_accepts, make_args, single_line_problems


@pytest.fixture
def args(tmp_path):
    return make_args(tmp_path)


GPU = Hardware("cuda", fp16=True, bf16=True)
CPU = Hardware("cpu", fp16=False, bf16=False)
pytestmark = pytest.mark.usefixtures("no_global_deepspeed_config")


# --- stock parity -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["zero3", "zero3_offload"])
def test_zero3_presets_bound_ram_on_cpu_only_hosts(preset, args, tmp_path):
    cpu = explain_deepspeed_config(preset, args, world_size=2, hardware=CPU, defer=True)
    gpu = explain_deepspeed_config(preset, args, world_size=2, hardware=GPU, defer=True)
    for key in CPU_ZERO3_KEYS:
        assert cpu.config["zero_optimization"][key] == CPU_ZERO3_GRANULARITY, key
        assert gpu.config["zero_optimization"][key] == 10**9, key  # transformers' documented values on GPUs
    assert any(c.key == "zero_optimization.sub_group_size" for c in cpu.changes)  # shown by `hf-ext ds resolve`
    # a user's own file with the same content is never changed
    own = tmp_path / "mine.json"
    own.write_text(json.dumps(load_deepspeed_config(preset)))
    mine = explain_deepspeed_config(own, args, world_size=2, hardware=CPU, defer=True)
    assert all(mine.config["zero_optimization"][key] == 10**9 for key in CPU_ZERO3_KEYS)


WARMUP_DECAY = ROOT / "recipes" / "configs" / "ds_zero2_warmup_decay.json"


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_leave_the_schedule_to_the_trainer(preset, tmp_path):
    """No preset has a scheduler section: transformers builds the Trainer's schedule (--lr_scheduler_type runs, as
    without DeepSpeed, and the checkpoint converts to FSDP2: tests/distributed/test_engines.py)."""
    assert "scheduler" not in load_deepspeed_config(preset)
    args, model = make_args(tmp_path, lr_scheduler_type="cosine"), SimpleNamespace(config=GPT2Config())
    if preset != "auto":  # auto's stage needs the memory planner's model (test_planner.py)
        resolution = explain_deepspeed_config(preset, args, model=model, world_size=1)
        assert "scheduler" not in resolution.config and not any("is ignored" in w for w in resolution.warnings)
    with_block = explain_deepspeed_config(str(WARMUP_DECAY), args, model=model, world_size=1)
    assert any("lr_scheduler_type cosine is ignored" in w for w in with_block.warnings)  # the block would win


@pytest.mark.parametrize("model_config", [GPT2Config(), "tiny"], ids=["gpt2-h768", "tiny-blenderbot"])
# the `auto` preset asks the memory planner for its stage, which transformers cannot fill (test_planner.py)
# and a config with DeepSpeed's own scheduler block (make demo's), whose "auto" keys transformers fills too
@pytest.mark.parametrize("preset", [*(p for p in PRESETS if p != "auto"), str(WARMUP_DECAY)])
def test_presets_match_what_transformers_fills(preset, model_config, args, tiny_model_dir):
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    if model_config == "tiny":
        model_config = BlenderbotConfig.from_pretrained(tiny_model_dir)
    model = SimpleNamespace(config=model_config)
    ours = resolve_deepspeed_config(preset, args, model=model, world_size=args.world_size)
    stock = HfTrainerDeepSpeedConfig(load_deepspeed_config(preset))
    stock.trainer_config_process(args)
    stock.trainer_config_finalize(args, model, args.max_steps)
    cpu_tuned = {f"zero_optimization.{k}" for k in CPU_ZERO3_KEYS} if args.device.type == "cpu" else set()
    for key, value in walk(stock.config):
        if key not in cpu_tuned:  # test_zero3_presets_bound_ram_on_cpu_only_hosts
            assert get_value(ours, key) == value, key
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        assert isinstance(ours["zero_optimization"].get(key, 0), int)
    assert [key for key, value in walk(ours) if value == "auto"] == []


def test_hidden_size_keys_are_integers_for_any_hidden_size():
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"}}  # fmt: skip
    fill_model_keys(config, GPT2Config(n_embd=1001))
    zero = config["zero_optimization"]
    assert all(type(zero[k]) is int for k in zero)
    assert zero["stage3_prefetch_bucket_size"] < zero["reduce_bucket_size"]


# --- normalizations ----------------------------------------------------------------------------------------------


def hf_view(config: dict):
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    return HfDeepSpeedConfig(copy.deepcopy(config))


def test_deprecated_cpu_offload_becomes_an_offload_section_transformers_sees():
    raw = {"zero_optimization": {"stage": 2, "cpu_offload": True}}
    assert not hf_view(raw).is_offload()
    config, report = normalize(raw)
    assert hf_view(config).is_offload()
    assert "cpu_offload" not in config["zero_optimization"]
    assert any(c.key == "zero_optimization.offload_optimizer" for c in report.changes)


@pytest.mark.parametrize("alias", ["stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"])
def test_gather_aliases_become_the_key_transformers_reads(alias):
    key = "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    raw = {"zero_optimization": {"stage": 3, alias: True}}
    assert hf_view(raw).get_value(key) is None
    config, _ = normalize(raw)
    assert hf_view(config).get_value(key) is True


def test_bfloat16_section_string_booleans_float_literals_and_whitespace(args):
    raw = {
        "bfloat16": {"enabled": "True"},
        "zero_optimization": {" stage ": "3", "sub_group_size": 1e9, "overlap_comm": "false"},
        "wall_clock_breakdown": "false",
    }
    assert hf_view(raw).is_true("wall_clock_breakdown")  # transformers reads the string "false" as true
    config = resolve_deepspeed_config(raw, args, world_size=1)
    assert config["bf16"] == {"enabled": True} and "bfloat16" not in config
    assert config["zero_optimization"]["stage"] == 3 and hf_view(config).is_zero3()
    assert type(config["zero_optimization"]["sub_group_size"]) is int
    assert config["zero_optimization"]["overlap_comm"] is False and config["wall_clock_breakdown"] is False


def test_zero_keys_at_top_level_move_into_zero_optimization(args):
    raw = {"zero_optimization": {"stage": 3}, "stage3_gather_16bit_weights_on_model_save": True, "overlap_comm": True}
    resolution = explain_deepspeed_config(raw, args, world_size=1)
    zero = resolution.config["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True and zero["overlap_comm"] is True
    assert "overlap_comm" not in resolution.config
    assert {c.key for c in resolution.changes if c.action == "moved"} >= {"zero_optimization.overlap_comm"}


def test_stage3_only_keys_below_stage3_are_warned_and_auto_ones_dropped(args):
    raw = {"zero_optimization": {"stage": 2, "sub_group_size": 1000, "stage3_prefetch_bucket_size": "auto"}}
    resolution = explain_deepspeed_config(raw, args, world_size=1)
    assert "stage3_prefetch_bucket_size" not in resolution.config["zero_optimization"]
    assert any("sub_group_size" in w and "stage 3" in w for w in resolution.warnings)


def test_comment_keys_are_dropped(args):
    config = resolve_deepspeed_config({"_comment": "see docs", "zero_optimization": {"stage": 1}}, args, world_size=1)
    assert "_comment" not in config


def test_top_level_gradient_checkpointing_turns_on_activation_checkpointing(tmp_path):
    raw = {"zero_optimization": {"stage": 2}, "gradient_checkpointing": True}
    args = make_args(tmp_path, deepspeed=raw)
    assert args.activation_checkpointing is True
    assert "gradient_checkpointing" not in args.deepspeed
    assert any("gradient_checkpointing" in w for w in args.deepspeed_resolution.warnings)


def test_missing_batch_and_clipping_keys_are_added_from_the_arguments(tmp_path):
    args = make_args(tmp_path, gradient_accumulation_steps=4, max_grad_norm=0.5)
    config = resolve_deepspeed_config({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}},
                                      args, world_size=2)  # fmt: skip
    assert config["gradient_accumulation_steps"] == 4 and config["gradient_clipping"] == 0.5
    assert deepspeed_accepts(config, world_size=2).gradient_accumulation_steps == 4


# --- precision ---------------------------------------------------------------------------------------------------


AUTO_PRECISION = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}


@pytest.mark.parametrize(
    "hardware, expected",
    [(GPU, "bf16"), (Hardware("cuda", fp16=True, bf16=False), "fp16"), (Hardware("cpu", True, True), None)],
)
def test_auto_precision_follows_the_hardware_when_arguments_say_nothing(hardware, expected, args):
    resolution = explain_deepspeed_config(AUTO_PRECISION, args, world_size=1, hardware=hardware)
    enabled = [name for name in ("fp16", "bf16") if resolution.config[name]["enabled"]]
    assert enabled == ([expected] if expected else [])
    assert resolution.args_updates == ({expected: True} if expected else {})


def test_detected_hardware_names_the_device_torch_sees():
    cpu = Hardware.detect(use_cpu=True)
    # DeepSpeed's CPU accelerator reports bf16 support (DESIGN.md); CPU runs train in fp32 all the same
    assert cpu.device == "cpu" and cpu.bf16 is True and cpu.default_precision() is None
    assert Hardware.detect().device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_explicit_precision_in_the_config_is_adopted_when_arguments_say_nothing(args):
    resolution = explain_deepspeed_config({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, args,
                                          world_size=1, hardware=GPU)  # fmt: skip
    assert resolution.args_updates == {"fp16": True} and resolution.config["bf16"]["enabled"] is False


def test_bf16_arguments_against_fp16_in_the_file_name_the_field(tmp_path):
    args = make_args(tmp_path, bf16=True)
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, args, world_size=1,
                                 hardware=GPU)  # fmt: skip
    assert [p.key for p in err.value.problems] == ["fp16.enabled"]
    assert "--bf16" in str(err.value)


def test_fp16_on_hardware_without_it_is_a_clear_error(args):
    no_fp16 = Hardware("cpu", fp16=False, bf16=True)
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, args, world_size=1,
                                 hardware=no_fp16)  # fmt: skip
    single_line_problems(err.value)
    (problem,) = err.value.problems
    assert problem.key == "fp16.enabled" and "no fp16 support" in problem.message


# --- mismatches and errors ---------------------------------------------------------------------------------------


def test_all_mismatches_are_raised_once_each_with_its_fix(tmp_path):
    args = make_args(tmp_path, learning_rate=1e-4, weight_decay=0.01, gradient_accumulation_steps=2)
    raw = {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 0}},
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.3,
        "zero_optimization": {"stage": 2},
    }
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(raw, args, world_size=1)
    keys = {p.key for p in err.value.problems}
    assert keys == {"optimizer.params.lr", "optimizer.params.betas", "optimizer.params.weight_decay",
                    "gradient_accumulation_steps", "gradient_clipping"}  # fmt: skip
    assert all(p.fix and p.args_fix for p in err.value.problems)
    fixed = make_args(tmp_path, **{k: v for p in err.value.problems for k, v in p.args_fix.items()})
    assert resolve_deepspeed_config(raw, fixed, world_size=1)["optimizer"]["params"]["lr"] == 3e-5


def test_matching_explicit_values_are_accepted_silently(args):
    raw = {
        "optimizer": {"type": "AdamW", "params": {"lr": args.learning_rate, "eps": args.adam_epsilon}},
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_clipping": args.max_grad_norm,
        "zero_optimization": {"stage": 2},
    }
    resolution = explain_deepspeed_config(raw, args, world_size=1)
    touched = {c.key for c in resolution.changes}
    assert not touched & {"optimizer.params.lr", "optimizer.params.eps", "train_micro_batch_size_per_gpu"}
    assert resolution.warnings == []


def test_auto_with_no_source_is_an_error_naming_the_key(args):
    raw = {"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(raw, args, world_size=1)
    assert [p.key for p in err.value.problems] == ["zero_optimization.allgather_bucket_size"]


def test_model_and_step_keys_need_their_source(tmp_path):
    args = make_args(tmp_path, max_steps=-1, num_train_epochs=1)
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(str(WARMUP_DECAY), args, world_size=1)
    keys = {p.key for p in err.value.problems}
    assert "zero_optimization.reduce_bucket_size" in keys and "scheduler.params.total_num_steps" in keys


def test_unknown_keys_at_every_level_say_what_was_meant(args):
    raw = {
        "steps_per_prnt": 10,
        "zero_optimization": {"stag": 2, "offload_optimizer": {"devise": "cpu"}},
        "fp16": {"enabled": False, "loss_scal": 0},
        "optimizer": {"type": "AdamWW", "params": {}},
        "scheduler": {"type": "WarmupLr", "params": {}},
    }
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(raw, args, world_size=1)
    single_line_problems(err.value)
    by_key = {p.key: p.message for p in err.value.problems}
    assert "steps_per_print" in by_key["steps_per_prnt"]
    assert "'stage'" in by_key["zero_optimization.stag"]
    assert "'device'" in by_key["zero_optimization.offload_optimizer.devise"]
    assert "'loss_scale'" in by_key["fp16.loss_scal"]
    assert "adamw" in by_key["optimizer.type"].lower() and "WarmupLR" in by_key["scheduler.type"]
    assert len(err.value.problems) == len(by_key) == 6  # one message per problem


def test_invalid_values_are_one_line_each(args):
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 0, "offload_param": {"device": "gpu"}}}
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(raw, args, world_size=1)
    single_line_problems(err.value)
    assert {p.key for p in err.value.problems} == {"zero_optimization.reduce_bucket_size",
                                                   "zero_optimization.offload_param.device"}  # fmt: skip


def test_json_syntax_errors_give_line_and_column(tmp_path, args):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "zero_optimization": {\n    "stage": 2\n    "overlap_comm": true\n  }\n}\n')
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(bad, args, world_size=1)
    (problem,) = err.value.problems
    assert f"{bad}:4:5:" in problem.message


def test_yaml_syntax_errors_give_line_and_column(tmp_path, args):
    bad = tmp_path / "bad.yaml"
    bad.write_text("deepspeed_config:\n  zero_stage: 2\n   offload: [\n")
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config(bad, args, world_size=1)
    assert f"{bad}:3:" in str(err.value.problems[0])


def test_duplicate_keys_are_rejected_like_deepspeed_does(tmp_path, args):
    dup = tmp_path / "dup.json"
    dup.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    with pytest.raises(DeepSpeedConfigError, match="stage"):
        resolve_deepspeed_config(dup, args, world_size=1)


def test_fp16_and_bf16_both_enabled_is_one_error(args):
    with pytest.raises(DeepSpeedConfigError) as err:
        resolve_deepspeed_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, args, world_size=1,
                                 hardware=GPU)  # fmt: skip
    assert len(err.value.problems) == 1


# --- TrainingArguments integration -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "auto"])  # `auto` needs plan_model: test_planner.py
def test_training_arguments_resolve_presets_and_stay_idempotent(preset, tmp_path):
    args = make_args(tmp_path, deepspeed=preset)
    deferred = {c.key for c in args.deepspeed_resolution.changes if c.action == "deferred"}
    assert {key for key, value in walk(args.deepspeed) if value == "auto"} == deferred
    assert args.hf_deepspeed_config.mismatches == []
    again = make_args(tmp_path, deepspeed=args.deepspeed)
    assert again.deepspeed == args.deepspeed


def test_training_arguments_raise_mismatches_at_construction(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match="optimizer.params.lr"):
        make_args(tmp_path, deepspeed={"optimizer": {"type": "AdamW", "params": {"lr": 1.0}}})
