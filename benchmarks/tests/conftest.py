"""Fixtures of the benchmarks' tests: a tiny BlenderBot and a tiny chat model, each built once per session by chat_e's
builders."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from chat_e.data.models import build

    return build(str(tmp_path_factory.mktemp("models") / "tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory) -> Path:
    from chat_e.data.models import build_chat_model

    return build_chat_model(tmp_path_factory.mktemp("models") / "tiny_chat", "tiny", seed=0)
