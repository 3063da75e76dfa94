"""FSDP2 as hf-ext's second engine: presets and checks of the ``fsdp`` settings (:mod:`.config`), and FSDP made real
on every host, CPU ranks included (:mod:`.engine`)."""

from ..gather import reshard
from .config import PRESETS, FsdpResolution, resolve_fsdp
from .engine import enable_on_trainer, shard_for_evaluation

__all__ = ["PRESETS", "FsdpResolution", "enable_on_trainer", "reshard", "resolve_fsdp", "shard_for_evaluation"]
