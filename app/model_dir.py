"""Recognise a model directory without loading it (kept free of heavy imports, so a bad path fails fast)."""

from __future__ import annotations

import json
from pathlib import Path


class ModelLoadError(RuntimeError):
    """A model directory is missing or cannot be loaded; the message names the path and what was expected."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err}).") from err
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object.")
    return data


def describe_model_dir(path: str | Path) -> dict:
    """What kind of model directory ``path`` is, without loading weights.

    Returns ``{"kind": "model" | "adapter", "path": Path, "base": Path | str | None}``: ``model`` is a 16-bit save or
    an exported merge (``config.json``), ``adapter`` a PEFT adapter (``adapter_config.json``) whose ``base`` is its
    base model. Raises :class:`ModelLoadError` naming the path when it is missing or is not a model directory.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"Model directory {path} does not exist.")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory; pass the directory the recipe saved the model in.")
    if (path / "adapter_config.json").is_file():
        if not any(path.glob("adapter_model.*")):
            raise ModelLoadError(f"{path} has an adapter_config.json but no adapter_model.safetensors (or .bin).")
        base = _read_json(path / "adapter_config.json").get("base_model_name_or_path")
        if not base:
            raise ModelLoadError(f"{path / 'adapter_config.json'} has no base_model_name_or_path.")
        if not Path(base).is_absolute() and (path / base).exists():
            base = path / base
        return {"kind": "adapter", "path": path, "base": Path(base) if Path(base).exists() else base}
    if (path / "config.json").is_file():
        _read_json(path / "config.json")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise ModelLoadError(
                f"{path} has a config.json but no weights (*.safetensors or *.bin): was the save interrupted?"
            )
        return {"kind": "model", "path": path, "base": None}
    raise ModelLoadError(
        f"{path} is not a model directory: expected config.json (a saved or exported model) or adapter_config.json "
        "(a PEFT adapter) in it."
    )
