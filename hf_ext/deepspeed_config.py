"""DeepSpeed configs: presets and loading (path, dict or preset name)."""

from __future__ import annotations

import json
from pathlib import Path

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS: tuple[str, ...] = tuple(sorted(p.stem for p in PRESET_DIR.glob("*.json")))


def preset_path(name: str) -> Path:
    """The JSON template of a preset (``zero1``, ``zero2``, ``zero3``, ``zero3_offload``)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown DeepSpeed preset {name!r}; choose one of {', '.join(PRESETS)} or give a path.")
    return PRESET_DIR / f"{name}.json"


def load_deepspeed_config(config: str | Path | dict) -> dict:
    """A DeepSpeed config as a fresh dict, from a dict, a JSON path or a preset name."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    config = str(config)
    if config in PRESETS:
        config = str(preset_path(config))
    return json.loads(Path(config).read_text(encoding="utf-8"))
