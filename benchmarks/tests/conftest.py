"""Fixtures of the benchmarks' tests: a tiny BlenderBot built once per session by chat_e's builder."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from chat_e.data.models import build

    return build(str(tmp_path_factory.mktemp("models") / "tiny"), "tiny", seed=0)
