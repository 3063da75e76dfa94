"""The peer tier notices a broken hf-ext: with checkpoint rotation no longer protecting the best checkpoint, both
rotation tests fail."""

from __future__ import annotations

import pytest

from hf_ext.saving import checkpoints

from .conftest import classes
from .test_peer_checkpointing import test_rotation_keeps_the_best_checkpoint_and_the_newest as rotation_test


@pytest.mark.peer_sides("hf_ext")
def test_rotating_away_the_best_checkpoint_fails_the_rotation_tests(tmp_path, monkeypatch):
    rotate = checkpoints.rotate_complete_checkpoints
    monkeypatch.setattr(checkpoints, "rotate_complete_checkpoints",
                        lambda run_dir, limit, best=None: rotate(run_dir, limit, best=None))  # fmt: skip
    # save_total_limit=2: checkpoint-5, the best, is rotated away while training
    with pytest.raises(AssertionError, match=r"At index 0 diff: 'checkpoint-20' != 'checkpoint-5'"):
        rotation_test(classes("hf_ext"), tmp_path / "two", save_total_limit=2)
    # save_total_limit=1: load_best_model_at_end finds no best checkpoint to load
    with pytest.raises(FileNotFoundError, match="checkpoint-5"):
        rotation_test(classes("hf_ext"), tmp_path / "one", save_total_limit=1)
    # the same calls pass with hf-ext's own rotation
    monkeypatch.setattr(checkpoints, "rotate_complete_checkpoints", rotate)
    rotation_test(classes("hf_ext"), tmp_path / "intact", save_total_limit=2)
