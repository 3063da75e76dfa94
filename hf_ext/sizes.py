"""Byte sizes: the one parser of ``"5GB"`` / ``"8GiB"`` / ``"512M"`` strings, the one formatter of byte counts, and
the size of a directory on disk."""

from __future__ import annotations

import re
from pathlib import Path

GiB = 1024**3
MiB = 1024**2

#: the largest safetensors shard a save writes unless told otherwise (transformers' default)
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: the dtypes weights can be exported in, by their short names: torch's names for them
SAVE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Hugging Face's convention (``max_shard_size="5GB"``): decimal units, and binary ones spelled with an "i".
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12}
_UNITS.update({"tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(size: str | int | float) -> int:
    """Bytes in ``size``: a number of bytes, or a string such as ``"5GB"`` (5e9), ``"8GiB"`` (8·2³⁰), ``"512M"``."""
    if isinstance(size, bool):
        raise ValueError(f"cannot read {size!r} as a size in bytes; write e.g. 5GB, 8GiB or 512MB")
    if isinstance(size, (int, float)):
        return int(size)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(size))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {size!r} as a size in bytes; write e.g. 5GB, 8GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def gb(n: float) -> str:
    """``n`` bytes for people: GiB from a quarter GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB / 4 else f"{n / MiB:.1f} MiB"


def dir_bytes(path: str | Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
