"""``hf-ext ds resolve`` and ``hf-ext ds doctor``: JSON then a table of sources; one line per problem; exit codes;
no traceback for user errors; every documented command parses (the console script: tests/integration/
test_cli_console.py)."""

from __future__ import annotations

import json

import pytest

from hf_ext.cli import main

from ..conftest import CORPUS, ROOT, walk

BROKEN = {
    "zero_optimization": {"stag": 3, "reduce_bucket_size": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}},
    "steps_per_prnt": 10,
}


pytestmark = pytest.mark.usefixtures("no_global_deepspeed_config")


def split_resolve_output(out: str) -> tuple[dict, list[str]]:
    """The JSON document and the table rows (comment lines dropped) of ``hf-ext ds resolve``."""
    json_part, _, table = out.partition("\n\n")
    rows = [line for line in table.splitlines() if line and not line.startswith("#")]
    return json.loads(json_part), rows


def test_resolve_prints_json_then_every_filled_key_with_its_source(capsys, tiny_model_dir, tmp_path):
    # a config with a scheduler block (the presets have none), whose step keys come from --max_steps
    config_file = ROOT / "recipes" / "configs" / "ds_zero2_warmup_decay.json"
    argv = ["ds", "resolve", str(config_file), "--model", str(tiny_model_dir), "--world_size", "2",
            "--per_device_train_batch_size", "3", "--max_steps", "7", "--output_dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    config, rows = split_resolve_output(capsys.readouterr().out)
    assert [key for key, value in walk(config) if value == "auto"] == []
    assert config["train_batch_size"] == 2 * 3 and config["scheduler"]["params"]["total_num_steps"] == 7
    header, *body = rows
    assert header.split()[:4] == ["key", "value", "action", "source"]
    listed = {row.split()[0] for row in body}
    preset = json.loads(config_file.read_text())
    assert {key for key, value in walk(preset) if value == "auto"} <= listed  # every "auto" has a row and a source
    bucket_row = next(row for row in body if row.startswith("zero_optimization.reduce_bucket_size "))
    assert "hidden_size" in bucket_row


def test_resolve_reports_every_problem_without_traceback(capsys, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(BROKEN))
    assert main(["ds", "resolve", str(path), "--output_dir", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    for key in (
        "zero_optimization.stag",
        "zero_optimization.reduce_bucket_size",
        "optimizer.params.lr",
        "steps_per_prnt",
    ):
        assert f"- {key}:" in captured.err


def test_doctor_prints_one_line_per_problem_and_exits_1(capsys, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(BROKEN))
    assert main(["ds", "doctor", str(path), "--output_dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 4  # stag, reduce_bucket_size, lr mismatch, steps_per_prnt
    assert all(line.startswith(("error: ", "warning: ")) for line in lines)


def test_doctor_exits_0_on_a_clean_preset(capsys, tmp_path):
    assert main(["ds", "doctor", "zero2", "--output_dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


def test_doctor_on_the_trailing_comma_file_warns_with_its_position(capsys, tmp_path):
    path = CORPUS / "axolotl-old__ds_config_trailing_comma.json"
    assert main(["ds", "doctor", str(path), "--output_dir", str(tmp_path)]) == 0
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "trailing comma" in line]
    assert f"{path}:" in warning


def test_doctor_reports_json_syntax_errors_with_line_and_column(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 2 "overlap_comm": true}}')
    assert main(["ds", "doctor", str(path), "--output_dir", str(tmp_path)]) == 1
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"error: {path}:1:")


def test_bad_training_arguments_flag_is_a_usage_error(capsys, tmp_path):
    assert main(["ds", "resolve", "zero2", "--no_such_flag", "1", "--output_dir", str(tmp_path)]) == 2
    assert "--no_such_flag" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["ds", "resolve"], ["ds", "doctor"], ["ds", "plan"], ["export"], ["ds"], []], ids=" ".join
)
def test_every_documented_command_has_help_that_exits_0(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-ext") and " ".join(argv) in out.splitlines()[0]


def test_commands_are_registered_in_one_place(capsys):
    """The documented commands parse through ``hf_ext.cli.main``; anything else is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out
    assert "ds" in listed and "export" in listed
    with pytest.raises(SystemExit) as exit_:
        main(["frobnicate"])
    assert exit_.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["ds", "frobnicate"])
    assert exit_.value.code == 2
    assert main([]) == 2  # no command: the help, on stderr
