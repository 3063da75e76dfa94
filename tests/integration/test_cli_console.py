"""The installed ``hf-ext`` console script, run as a user runs it: one line per problem, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT, launch_env, run_side_by_side

pytestmark = pytest.mark.slow
BROKEN = {
    "zero_optimization": {"stag": 3, "reduce_bucket_size": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5}},
    "steps_per_prnt": 10,
}


def test_console_script_has_no_traceback_on_user_errors(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(BROKEN))
    script = Path(sys.executable).parent / "hf-ext"
    proc = subprocess.run([str(script), "ds", "doctor", str(path), "--output_dir", str(tmp_path)],
                          capture_output=True, text=True, env=launch_env(), timeout=300)  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stdout + proc.stderr
    assert sum(line.startswith("error: ") for line in proc.stdout.splitlines()) == 4


def test_console_script_says_one_line_for_each_unreadable_file(tmp_path):
    """The four files that used to end in a traceback: UTF-16, random bytes, 100,000 levels of nesting, and an
    accelerate YAML with ``zero_stage: three``. One process per file, as a user would run them."""
    files = {
        "utf16.json": json.dumps(BROKEN).encode("utf-16"),
        "bytes.json": bytes(range(256)) * 4,
        "deep.json": ("[" * 100_000 + "]" * 100_000).encode(),
        "accelerate.yaml": b"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: three\n",
    }
    script = Path(sys.executable).parent / "hf-ext"
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    procs = run_side_by_side(
        [[str(script), "ds", "doctor", str(tmp_path / name), "--output_dir", str(tmp_path)] for name in files]
    )
    for name, proc in zip(files, procs):
        output = (proc.stdout + proc.stderr).strip().splitlines()
        output = [line for line in output if "real_accelerator.py" not in line]  # DeepSpeed's import-time notice
        assert proc.returncode == 1 and len(output) == 1 and output[0].startswith("error: "), (name, output)


def test_fsdp_doctor_one_line_per_problem_then_the_fix_resolves(tmp_path):
    script = Path(sys.executable).parent / "hf-ext"
    # an accelerate launch config file: accelerate itself would run it with the typo ignored
    yaml_file = tmp_path / "fsdp.yaml"
    yaml_file.write_text((ROOT / "recipes" / "accelerate" / "fsdp.yaml").read_text().replace(
        "fsdp_state_dict_type", "fsdp_state_dict_typ"))  # fmt: skip
    doctor = [str(script), "fsdp", "doctor"]
    broken, fixed, broken_yaml, recipe = run_side_by_side([
        [*doctor, "hybrid_shard", "--fsdp_config", config, "--world_size", "4"]
        for config in ('{"sharding_factor": 3, "verison": 2}', '{"sharding_factor": 2, "version": 2}')
    ] + [[*doctor, "--accelerate_config", str(path)]
         for path in (yaml_file, ROOT / "recipes" / "accelerate" / "fsdp.yaml")])  # fmt: skip
    assert broken.returncode == 1 and "Traceback" not in broken.stdout + broken.stderr
    assert broken.stdout.splitlines() == [
        "error: fsdp_config.verison: unknown key. Fix: did you mean 'version'?",
        "error: fsdp_config.sharding_factor: 3 does not divide the 4 ranks into equal groups. Fix: set it to one of "
        '1, 2, 4 (or "auto": the ranks of one node)',
    ]
    assert fixed.returncode == 0
    assert fixed.stdout.splitlines()[0] == (
        "ok: hybrid_shard on 4 ranks runs FSDP2: each parameter split over 2 rank(s), 2 replica(s) of each shard"
    )
    assert broken_yaml.returncode == 1 and broken_yaml.stdout.splitlines() == [
        "error: fsdp_config.fsdp_state_dict_typ: unknown key: accelerate launch ignores it. "
        "Fix: did you mean 'fsdp_state_dict_type'?"
    ]
    assert recipe.returncode == 0 and recipe.stdout.startswith("ok: full_shard on 2 ranks runs FSDP2")
