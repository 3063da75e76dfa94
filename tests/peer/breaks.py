"""Deliberate breaks of hf-ext, loaded as a pytest plugin (``-p tests.peer.breaks``) by test_peer_breaks.py only: each
must make a peer test fail, or the tier would not notice hf-ext losing a stock behaviour."""

from __future__ import annotations

import os


def pytest_configure(config):
    if os.environ.get("HF_EXT_PEER_BREAK") == "rotation-drops-best":
        from hf_ext.saving import checkpoints

        rotate = checkpoints.rotate_complete_checkpoints

        def rotate_without_best(run_dir, save_total_limit, best=None):
            return rotate(run_dir, save_total_limit, best=None)  # the best checkpoint is no longer protected

        checkpoints.rotate_complete_checkpoints = rotate_without_best
