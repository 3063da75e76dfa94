"""FSDP2 as hf-ext's second engine: presets and checks of the ``fsdp`` settings (:mod:`.config`), and FSDP made real
on every host, CPU ranks included (:mod:`.engine`). Names below are imported on first use: checking settings
(``hf-ext fsdp doctor``) needs no engine."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "reshard": "..gather",
    "PRESETS": ".config",
    "FsdpResolution": ".config",
    "resolve_fsdp": ".config",
    "enable_on_trainer": ".engine",
    "shard_for_evaluation": ".engine",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
