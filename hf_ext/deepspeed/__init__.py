"""DeepSpeed configs that just work: load (JSON, accelerate YAML, dict, preset), normalize old spellings, fill every
``"auto"`` against TrainingArguments and the model, validate with DeepSpeed's own config models, report every problem
at once with its fix.

Names below are imported on first use: reading a config (:mod:`.load`) stays light, so that ``hf-ext ds doctor`` of a
file it cannot read says so at once, before torch and transformers are imported for the rest."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS = {
    "Change": "..errors",
    "DeepSpeedConfigError": "..errors",
    "Problem": "..errors",
    "ResolvedDeepSpeedConfigCallback": ".callbacks",
    "add_resolved_config_callback": ".callbacks",
    "fill_model_keys_on_trainer": ".callbacks",
    "reopen_step_keys": ".callbacks",
    "write_resolved_config": ".callbacks",
    "PRESET_DIR": ".load",
    "PRESETS": ".load",
    "preset_path": ".load",
    "RESOLVED_CONFIG_NAME": ".resolve",
    "Resolution": ".resolve",
    "explain_deepspeed_config": ".resolve",
    "fill_model_keys": ".resolve",
    "load_deepspeed_config": ".resolve",
    "resolve_deepspeed_config": ".resolve",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
