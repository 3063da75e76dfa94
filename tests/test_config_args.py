"""--config YAML + CLI flags: precedence and unknown keys."""

import pytest

from hf_ext import Seq2SeqTrainingArguments
from hf_ext.config_args import parse_args_with_config
from hf_ext.data import DataArguments

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
