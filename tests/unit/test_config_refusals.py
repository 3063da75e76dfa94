"""One named regression test per class of broken config found by trying malformed variants of real public configs:
each ends in a correct resolution or in exactly one line naming the key (or the file), the problem, and a fix that
works (applied here, the config then resolves). DeepSpeed's own config classes are the oracle for what a value
means."""

from __future__ import annotations

import copy
import json
import os

import pytest

from hf_ext import explain_deepspeed_config
from hf_ext.cli import main
from hf_ext.deepspeed.resolve import Hardware

from ..conftest import CORPUS
from ..ds_support import deepspeed_accepts, make_args

GPU = Hardware("cuda", fp16=True, bf16=True)
CPU = Hardware("cpu", fp16=False, bf16=True)
pytestmark = pytest.mark.usefixtures("no_global_deepspeed_config")

BASE = {
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },  # fmt: skip
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
}


def variant(**changes) -> dict:
    """BASE with dotted keys set (``None`` deletes)."""
    config = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def problems_of(config, tmp_path, world=1, hardware=GPU, **args):
    resolution = explain_deepspeed_config(config, make_args(tmp_path, **args), None, world, defer=True,
                                          raise_errors=False, hardware=hardware)  # fmt: skip
    return resolution.problems


def the_one_problem(config, tmp_path, **kwargs):
    problems = problems_of(config, tmp_path, **kwargs)
    assert len(problems) == 1, [str(p) for p in problems]
    problem = problems[0]
    assert problem.fix and "\n" not in str(problem)
    return problem


def resolves(config, tmp_path, world=1, **args):
    resolution = explain_deepspeed_config(config, make_args(tmp_path, **args), None, world, defer=True,
                                          raise_errors=True, hardware=GPU)  # fmt: skip
    deepspeed_accepts(resolution.config, world_size=world)
    return resolution


# --- 1. tracebacks on bad bytes and shapes ------------------------------------------------------------------------


def test_utf16_file_is_one_line_saying_how_to_resave_it(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE), encoding="utf-16")  # what PowerShell's `>` writes
    problem = the_one_problem(path, tmp_path)
    assert "UTF-16" in problem.message and str(path) in problem.message and "UTF-8" in problem.fix
    fixed = tmp_path / "fixed.json"
    fixed.write_text(path.read_text(encoding="utf-16"), encoding="utf-8")  # the fix
    resolves(fixed, tmp_path)


def test_random_bytes_named_json_are_one_line(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(bytes(range(128, 256)) * 3)
    problem = the_one_problem(path, tmp_path)
    assert "not a text config file" in problem.message and str(path) in problem.message


def test_json_nested_100000_levels_is_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    assert "nested more than" in the_one_problem(path, tmp_path).message


def test_accelerate_yaml_zero_stage_three_names_the_yaml_key(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: three\nmixed_precision: 'no'\n")
    problem = the_one_problem(path, tmp_path)
    assert problem.key == "deepspeed_config.zero_stage" and "0, 1, 2 or 3" in problem.fix
    path.write_text(path.read_text().replace("three", "3"))
    assert resolves(path, tmp_path).config["zero_optimization"]["stage"] == 3


@pytest.mark.parametrize("name", ["utf16", "binary", "deep", "zero_stage_three"])
def test_doctor_prints_one_line_and_exits_1_on_each_unreadable_file(name, tmp_path, capsys):
    path = tmp_path / ("accelerate.yaml" if name == "zero_stage_three" else "ds.json")
    if name == "utf16":
        path.write_text(json.dumps(BASE), encoding="utf-16")
    elif name == "binary":
        path.write_bytes(os.urandom(512).replace(b"{", b"\x00"))
    elif name == "deep":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        path.write_text("deepspeed_config:\n  zero_stage: three\n")
    assert main(["ds", "doctor", str(path), "--output_dir", str(tmp_path / "out")]) == 1
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out.err, lines


# --- 2. silently accepted, wrong ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, typo, right, number",
    [("optimizer", "weight_decya", "weight_decay", 0.0), ("scheduler", "warmup_num_step", "warmup_num_steps", 10)],
)
@pytest.mark.parametrize("explicit", [True, False], ids=["value", "auto"])
def test_misspelt_optimizer_and_scheduler_params_are_named_with_the_right_spelling(section, typo, right, number,
                                                                                    explicit, tmp_path):  # fmt: skip
    value = number if explicit else "auto"
    config = copy.deepcopy(BASE)
    params = config[section]["params"]
    params.pop(right, None)
    params[typo] = value
    problem = the_one_problem(config, tmp_path)
    assert problem.key == f"{section}.params.{typo}" and repr(right) in problem.fix
    params[right] = params.pop(typo)  # the fix
    resolves(config, tmp_path)


def test_param_the_constructor_deepspeed_calls_lacks_is_refused(tmp_path):
    # WarmupCosineLR takes ratios, not warmup_max_lr: its constructor would fail at engine start
    config = variant(scheduler={"type": "WarmupCosineLR", "params": {"warmup_max_lr": 0.1, "total_num_steps": 10}})
    problem = the_one_problem(config, tmp_path)
    assert problem.key == "scheduler.params.warmup_max_lr" and "WarmupCosineLR" in problem.message
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    with pytest.raises(TypeError):  # the oracle: the constructor DeepSpeed would call
        WarmupCosineLR(None, warmup_max_lr=0.1, total_num_steps=10)


@pytest.mark.parametrize("spelling", ["yes", "on", "1", 1, "True"])
def test_boolean_spellings_mean_what_deepspeed_reads(spelling, tmp_path):
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    assert DeepSpeedFP16Config(enabled=spelling).enabled is True  # DeepSpeed's reading
    resolution = resolves(variant(fp16={"enabled": spelling}), tmp_path)
    assert resolution.config["fp16"]["enabled"] is True and resolution.args_updates.get("fp16") is True


def test_boolean_stage_is_refused_not_read_as_one(tmp_path):
    problem = the_one_problem(variant(zero_optimization__stage=True), tmp_path)
    assert problem.key == "zero_optimization.stage" and "boolean" in problem.message


def test_legacy_cpu_offload_next_to_offload_optimizer_is_refused_like_deepspeed_does(tmp_path):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(Exception, match="together"):
        DeepSpeedZeroConfig(**zero)  # the oracle: DeepSpeed refuses the pair
    problem = the_one_problem(variant(zero_optimization=zero), tmp_path)
    assert problem.key == "zero_optimization.cpu_offload"
    zero.pop("cpu_offload")  # the fix
    resolves(variant(zero_optimization=zero), tmp_path)


def test_nvme_offload_without_a_path_is_refused(tmp_path):
    zero = {"stage": 3, "offload_param": {"device": "nvme"}}
    problem = the_one_problem(variant(zero_optimization=zero), tmp_path)
    assert problem.key == "zero_optimization.offload_param.nvme_path"


@pytest.mark.parametrize("value", [1e30, 2**64, float("inf")])
def test_integer_out_of_int64_range_is_refused(value, tmp_path):
    problem = the_one_problem(variant(zero_optimization__reduce_bucket_size=value), tmp_path)
    assert problem.key == "zero_optimization.reduce_bucket_size"


def test_accelerate_mixed_precision_fp17_is_refused(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("deepspeed_config:\n  zero_stage: 2\nmixed_precision: fp17\n")
    problem = the_one_problem(path, tmp_path)
    assert problem.key == "mixed_precision" and "bf16" in problem.fix


# --- 3. misleading fixes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, text",
    [("gradient_accumulation_steps", -1, "-1"), ("train_micro_batch_size_per_gpu", 0, "0"),
     ("gradient_clipping", float("nan"), "NaN")],
)  # fmt: skip
def test_out_of_range_value_is_invalid_not_a_mismatch_to_pass_on(key, value, text, tmp_path):
    problem = the_one_problem(variant(**{key: value}), tmp_path)
    assert problem.key == key and not problem.args_fix and "--" not in problem.fix
    assert text not in problem.fix.split() and '"auto"' in problem.fix


def test_directory_is_called_a_directory(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "ds.json").write_text(json.dumps(BASE))
    problem = the_one_problem(tmp_path / "cfg", tmp_path)
    assert "is a directory" in problem.message and "ds.json" in problem.message


@pytest.mark.parametrize("key, value", [("zero_optimization", 3), ("optimizer__params", [1, 2])])
def test_non_section_where_a_section_goes_names_the_key(key, value, tmp_path):
    problem = the_one_problem(variant(**{key: value}), tmp_path)
    assert problem.key == key.replace("__", ".") and "section" in problem.message


# --- 4. all problems at once --------------------------------------------------------------------------------------


def test_removed_deepspeed_features_are_reported_with_every_other_problem(tmp_path):
    config = variant(amp={"enabled": True}, sparse_attention={"mode": "fixed"}, steps_per_prnt=10,
                     gradient_accumulation_steps=4)  # fmt: skip
    keys = sorted(p.key for p in problems_of(config, tmp_path))
    assert keys == ["amp", "gradient_accumulation_steps", "sparse_attention", "steps_per_prnt"]


def test_batch_arithmetic_that_cannot_hold_is_one_problem_whose_fix_works(tmp_path):
    config = variant(train_batch_size=16, train_micro_batch_size_per_gpu=16)
    problem = the_one_problem(config, tmp_path, world=2)
    assert problem.key == "train_batch_size" and "2 ranks x micro-batch 16 x accumulation 1 = 32" in problem.message
    assert "--gradient_accumulation_steps" in problem.fix
    config["train_micro_batch_size_per_gpu"] = "auto"  # the fix: the key to "auto", then the flags it names
    flags = problem.fix.split("pass ")[1].split(" (")[0].split()
    kwargs = {flags[i].lstrip("-"): int(flags[i + 1]) for i in range(0, len(flags), 2)}
    assert resolves(config, tmp_path, world=2, **kwargs).config["train_batch_size"] == 16


def test_non_integral_min_loss_scale_is_refused_with_a_value_deepspeed_accepts(tmp_path):
    problem = the_one_problem(variant(fp16={"enabled": True, "min_loss_scale": 0.5}), tmp_path)
    assert problem.key == "fp16.min_loss_scale" and problem.fix.endswith("1")
    resolves(variant(fp16={"enabled": True, "min_loss_scale": 1}), tmp_path)


# --- 5. wording ---------------------------------------------------------------------------------------------------


def test_words_in_another_order_get_a_did_you_mean(tmp_path):
    problem = the_one_problem(variant(zero_optimization__comm_overlap=True), tmp_path)
    assert "did you mean 'overlap_comm'" in problem.message and "'overlap_comm'" in problem.fix


def test_stage_choices_are_listed_once(tmp_path):
    problem = the_one_problem(variant(zero_optimization__stage=7), tmp_path)
    assert "0, 1, 2 or 3" in problem.message and "3 or 3" not in problem.message


def test_precision_refusal_reads_plainly(tmp_path):
    problem = the_one_problem(variant(fp16={"enabled": True}), tmp_path, hardware=CPU)
    assert problem.key == "fp16.enabled" and "((" not in str(problem) and "said nothing" not in str(problem)


def test_another_tools_config_is_one_line(tmp_path):
    # the shape of a GPT-NeoX training config: model, data and schedule keys around a few DeepSpeed sections
    neox = {"pipe_parallel_size": 1, "model_parallel_size": 1, "num_layers": 12, "hidden_size": 768,
            "num_attention_heads": 12, "seq_length": 2048, "norm": "layernorm", "pos_emb": "rotary",
            "optimizer": {"type": "Adam", "params": {"lr": 0.0006}}, "zero_optimization": {"stage": 1},
            "train_micro_batch_size_per_gpu": 4, "data_impl": "mmap", "train_iters": 320000,
            "lr_decay_style": "cosine", "fp16": {"enabled": True}}  # fmt: skip
    path = tmp_path / "125M.yml"
    path.write_text(json.dumps(neox, indent=2))
    problem = the_one_problem(path, tmp_path)
    assert "is not a DeepSpeed config" in problem.message and str(path) in problem.message


def test_every_vendored_config_still_has_its_outcome_after_these_rules():
    # the corpus test (test_deepspeed_corpus.py) checks outcomes; here: no corpus file is called foreign
    from hf_ext.deepspeed.load import load
    from hf_ext.deepspeed.resolve import _not_deepspeed
    from hf_ext.errors import Report

    for path in sorted(p for p in CORPUS.glob("*.json") if p.name != "EXPECTED.json"):
        assert _not_deepspeed(load(str(path), Report()), str(path)) is None, path.name


def test_a_chosen_lr_scheduler_type_the_config_scheduler_overrides_is_warned_about(tmp_path):
    config = variant(scheduler={"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto"}})
    resolution = resolves(config, tmp_path, lr_scheduler_type="cosine")
    assert any("lr_scheduler_type cosine is ignored" in w and "WarmupCosineLR" in w for w in resolution.warnings)
    assert not any("lr_scheduler_type" in w for w in resolves(config, tmp_path).warnings)  # the default: silent
