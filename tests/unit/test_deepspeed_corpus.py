"""The real-world config corpus (tests/data/deepspeed_configs, copied from public repositories): each file resolves
or fails exactly as EXPECTED.json says, and the accelerate YAML forms reach the same configs.

The expected outcomes were written from each config and DeepSpeed's rules (see the "why" of each entry), for the
arguments of :func:`make_args` on a host with fp16 and bf16, so that they hold on any machine. A valid file that
starts failing, a failing one that starts resolving, or a failure that names other keys fails its test.

The trailing-comma file (axolotl's 2023 ``ds_config.json``) is *accepted* with a warning giving line and column:
DeepSpeed's own loader (hjson) reads it, only transformers' strict ``json.load`` does not.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from hf_ext import DeepSpeedConfigError, explain_deepspeed_config, load_deepspeed_config, resolve_deepspeed_config
from hf_ext.deepspeed.load import accelerate_launch_config
from hf_ext.deepspeed.resolve import Hardware

from ..conftest import CORPUS, ROOT, walk
from ..ds_support import deepspeed_accepts, make_args, single_line_problems, stock_mismatches

EXPECTED = json.loads((CORPUS / "EXPECTED.json").read_text())
CORPUS_FILES = sorted(
    p for p in CORPUS.iterdir() if p.suffix in (".json", ".yaml", ".yml") and p.name != "EXPECTED.json"
)
TRAILING_COMMA = CORPUS / "axolotl-old__ds_config_trailing_comma.json"
GPU = Hardware("cuda", fp16=True, bf16=True)
pytestmark = pytest.mark.usefixtures("no_global_deepspeed_config")


@pytest.fixture
def args(tmp_path):
    return make_args(tmp_path)


def test_every_vendored_file_has_a_source_and_an_expected_outcome():
    with open(CORPUS / "SOURCES.tsv", newline="") as f:
        sources = {row["saved_name"] for row in csv.DictReader(f, delimiter="\t")}
    names = {p.name for p in CORPUS_FILES}
    assert len(names) == 42 and names == sources == set(EXPECTED)
    for name, expected in EXPECTED.items():
        assert expected["outcome"] in ("resolves", "fails"), name
        assert (expected["outcome"] == "fails") == bool(expected.get("keys")), name


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_corpus_file_has_its_expected_outcome(path, tmp_path, tiny_model_dir):
    expected = EXPECTED[path.name]
    if expected["outcome"] == "fails":
        with pytest.raises(DeepSpeedConfigError) as err:
            explain_deepspeed_config(path, make_args(tmp_path), model=tiny_model_dir, hardware=GPU)
        single_line_problems(err.value)
        assert sorted(p.key for p in err.value.problems) == sorted(expected["keys"])
        fixes = [p.args_fix for p in err.value.problems]
        if not all(fixes):
            return  # a missing file or an invalid value: no argument fixes it
        # every mismatch names the arguments that fix it; with them the same file resolves
        kwargs = {k: v for fix in fixes for k, v in fix.items()}
        resolution = explain_deepspeed_config(path, make_args(tmp_path, **kwargs), model=tiny_model_dir, hardware=GPU)
    else:
        kwargs = {}
        resolution = explain_deepspeed_config(path, make_args(tmp_path), model=tiny_model_dir, hardware=GPU)
    config = resolution.config
    assert [key for key, value in walk(config) if value == "auto"] == []
    deepspeed_accepts(config, world_size=1)
    # transformers' own glue, given the arguments the config implies, agrees with every value
    assert stock_mismatches(config, make_args(tmp_path, **kwargs, **resolution.args_updates)) == []


def test_trailing_comma_file_is_read_with_a_warning_naming_line_and_column(args, tiny_model_dir):
    text = TRAILING_COMMA.read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # what transformers' HfDeepSpeedConfig does with it
    resolution = explain_deepspeed_config(TRAILING_COMMA, args, model=tiny_model_dir, world_size=2)
    (warning,) = [w for w in resolution.warnings if "trailing comma" in w]
    line, col = (int(n) for n in warning.split(":", 3)[1:3])
    assert text.splitlines()[line - 1][col - 1] == ","


def test_accelerate_yaml_follows_its_relative_deepspeed_config_file(tmp_path, args):
    shutil.copy(CORPUS / "accelerate-ex__sp-alst.accelerate-config.yml", tmp_path / "accelerate.yml")
    shutil.copy(CORPUS / "accelerate-ex__sp-alst.ds-config.json", tmp_path / "sp-alst.ds-config.json")
    config = resolve_deepspeed_config(tmp_path / "accelerate.yml", args, world_size=2)
    assert config["zero_optimization"]["stage"] == 3
    assert config["bf16"]["enabled"] is True  # hard-coded in the JSON the YAML points to


def test_inline_accelerate_yaml_becomes_a_deepspeed_config(args):
    resolution = explain_deepspeed_config(CORPUS / "alignment-handbook__zero3.yaml", args, world_size=2)
    zero = resolution.config["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert resolution.config["bf16"]["enabled"] is True and resolution.args_updates == {"bf16": True}


def accelerate_launch_env(yaml_path: Path) -> dict:
    """The environment ``accelerate launch --config_file yaml_path`` gives a DeepSpeed script (accelerate's own code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    cli = launch_command_parser().parse_args(["--config_file", str(yaml_path), "--num_processes", "2", "train.py"])
    cli, defaults, _ = _validate_launch_command(cli)
    cli.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as launch_command() sets it
    return prepare_deepspeed_cmd_env(cli)[1]


def test_accelerate_launch_inline_yaml_resolves_like_the_yaml_itself(args):
    yaml_path = CORPUS / "alignment-handbook__zero3.yaml"
    from_env = accelerate_launch_config(accelerate_launch_env(yaml_path))
    assert isinstance(from_env, dict) and from_env["zero_optimization"]["stage"] == 3
    via_launch = resolve_deepspeed_config(from_env, args, world_size=2)
    assert via_launch == resolve_deepspeed_config(yaml_path, args, world_size=2)
    assert via_launch["bf16"]["enabled"] is True  # the YAML's mixed_precision: bf16 survives the launcher


def test_accelerate_launch_config_file_yaml_gives_the_file():
    yaml_path = ROOT / "recipes" / "accelerate" / "zero2.yaml"
    given = accelerate_launch_config(accelerate_launch_env(yaml_path))
    # the file the YAML names (hf-ext's zero2 preset), which loads as that preset
    assert given == "hf_ext/deepspeed/presets/zero2.json"
    assert load_deepspeed_config(given) == load_deepspeed_config("zero2")
    assert accelerate_launch_config({"ACCELERATE_MIXED_PRECISION": "no"}) is None  # not an accelerate DeepSpeed run
