"""The peer tier notices a broken hf-ext: rotating checkpoints without keeping the best one fails its test."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

ROTATION = "tests/peer/test_peer_checkpointing.py::test_rotation_keeps_the_best_checkpoint_and_the_newest"


@pytest.mark.peer_sides("hf_ext")
def test_rotating_away_the_best_checkpoint_fails_the_rotation_test(tmp_path):
    env = {**os.environ, "HF_EXT_PEER": "hf_ext", "HF_EXT_PEER_BREAK": "rotation-drops-best"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            ROTATION,
            "-p",
            "tests.peer.breaks",
            "-q",
            "-rf",
            "-p",
            "no:cacheprovider",
            "--basetemp",
            str(tmp_path),
            "-o",
            "addopts=",
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "2 failed" in out and "passed" not in out, out[-3000:]
    # save_total_limit=2: checkpoint-5 rotated away while training; =1: load_best_model_at_end finds no best to load
    assert "At index 0 diff: 'checkpoint-20' != 'checkpoint-5'" in out, out[-3000:]
    assert "FileNotFoundError" in out and "checkpoint-5" in out, out[-3000:]
