"""The one classifier of model directories, without loading anything: a full model, a PEFT adapter, a ZeRO
checkpoint, or nothing usable (export and the Chat-E app both ask here)."""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
#: DeepSpeed's checkpoint: the file naming the newest tag (a ``global_stepN`` folder beside it)
DEEPSPEED_TAG_FILE = "latest"
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


class ModelDirError(ValueError):
    """A model directory is missing or unusable; the message names the path and what was expected."""


def has_zero_checkpoint(path: str | Path) -> bool:
    """A DeepSpeed checkpoint (its ``latest`` tag file next to ``global_step*``)."""
    return (Path(path) / DEEPSPEED_TAG_FILE).is_file()


def _has_weights(path: Path) -> bool:
    # a CLI that checks its arguments and model directory first (chat-e) answers a mistake without torch
    from ..model_info import TRAINING_ARGS_NAME  # noqa: PLC0415 (model_info imports torch and transformers)

    return any(p.is_file() and p.name != TRAINING_ARGS_NAME for pattern in WEIGHT_GLOBS for p in path.glob(pattern))


def model_dir_kind(path: str | Path) -> str | None:
    """``"adapter"`` (``adapter_config.json``), ``"model"`` (``config.json`` and weights), ``"zero"`` (a ZeRO
    checkpoint only) or ``None``."""
    path = Path(path)
    if (path / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (path / "config.json").is_file() and _has_weights(path):
        return "model"
    if has_zero_checkpoint(path):
        return "zero"
    return None


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file (llama.cpp's single-file model), by its magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelDirError(f"{path} is not valid JSON ({err}).") from err
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} should hold a JSON object.")
    return data


def describe_model_dir(path: str | Path) -> dict:
    """What a servable model directory holds, checked: ``{"kind": "model" | "adapter" | "gguf", "path", "base"}``
    (``gguf``: a GGUF file, which llama.cpp serves).

    ``base`` is an adapter's base model (a path when it exists, else a hub id). Raises :class:`ModelDirError` naming
    the path when it is missing, broken, or not a model directory.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelDirError(f"Model directory {path} does not exist.")
    if is_gguf_file(path):
        return {"kind": "gguf", "path": path, "base": None}
    if not path.is_dir():
        raise ModelDirError(
            f"{path} is neither a model directory nor a GGUF file; pass the directory the recipe saved the model in."
        )
    kind = model_dir_kind(path)
    if kind == "adapter":
        if not any(path.glob("adapter_model.*")):
            raise ModelDirError(f"{path} has an {ADAPTER_CONFIG} but no adapter_model.safetensors (or .bin).")
        base = _read_json(path / ADAPTER_CONFIG).get("base_model_name_or_path")
        if not base:
            raise ModelDirError(f"{path / ADAPTER_CONFIG} has no base_model_name_or_path.")
        if not Path(base).is_absolute() and (path / base).exists():
            base = path / base
        return {"kind": "adapter", "path": path, "base": Path(base) if Path(base).exists() else base}
    if (path / "config.json").is_file():
        _read_json(path / "config.json")
        if kind != "model":
            raise ModelDirError(
                f"{path} has a config.json but no weights (*.safetensors or *.bin): was the save interrupted?"
            )
        return {"kind": "model", "path": path, "base": None}
    raise ModelDirError(
        f"{path} is not a model directory: expected config.json (a saved or exported model) or {ADAPTER_CONFIG} "
        "(a PEFT adapter) in it."
    )
