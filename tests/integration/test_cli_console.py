"""The installed ``hf-ext`` console script, run as a user runs it: one line per problem, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import launch_env

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
