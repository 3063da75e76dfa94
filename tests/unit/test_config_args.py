"""--config YAML + CLI flags: precedence and unknown keys."""

import pytest

from chat_e.data.corpora import DataArguments
from hf_ext import Seq2SeqTrainingArguments
from hf_ext.config_args import parse_args_with_config

TYPES = (DataArguments, Seq2SeqTrainingArguments)


def test_cli_overrides_yaml_overrides_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("n_train: 10\nlearning_rate: 0.001\nmax_source_length: 64\nreport_to: none\n")
    data, train = parse_args_with_config(TYPES, ["--config", str(cfg), "--n_train", "5", "--output_dir", "x"])
    assert data.n_train == 5 and data.max_source_length == 64 and train.learning_rate == 0.001
    assert data.max_target_length == DataArguments().max_target_length


def test_unknown_yaml_key_is_named(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("n_train: 10\nnum_train_epoch: 3\n")
    with pytest.raises(SystemExit) as exc:
        parse_args_with_config(TYPES, ["--config", str(cfg)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unknown key 'num_train_epoch'" in err and "did you mean 'num_train_epochs'" in err
    assert "usage:" not in err and "Traceback" not in err


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args_with_config(TYPES, ["--config", str(tmp_path / "nope.yaml")])
    assert "no such file" in capsys.readouterr().err


def test_micro_batch_auto_from_the_command_line(tmp_path, tiny_model_dir):
    """`--per_device_train_batch_size auto` reaches the memory planner, which picks the micro-batch."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    argv = ["--output_dir", str(tmp_path), "--report_to", "none", "--deepspeed", "zero2",
            "--per_device_train_batch_size", "auto", "--plan_model", str(tiny_model_dir), "--plan_seq_len", "16",
            "--memory_per_device", "2GB"]  # fmt: skip
    try:
        (args,) = parse_args_with_config((Seq2SeqTrainingArguments,), argv)
        assert isinstance(args.per_device_train_batch_size, int) and args.per_device_train_batch_size >= 1
        assert args.memory_plan.micro_batch == args.per_device_train_batch_size
    finally:
        unset_hf_deepspeed_config()


def test_micro_batch_must_be_an_integer_or_auto(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args_with_config(
            (Seq2SeqTrainingArguments,), ["--output_dir", str(tmp_path), "--per_device_train_batch_size", "lots"]
        )
    assert "expected an integer or auto, got 'lots'" in capsys.readouterr().err
