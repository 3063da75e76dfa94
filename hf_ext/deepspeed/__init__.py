"""DeepSpeed configs that just work: load (JSON, accelerate YAML, dict, preset), normalize old spellings, fill every
``"auto"`` against TrainingArguments and the model, validate with DeepSpeed's own config models, report every problem
at once with its fix."""

from ..errors import Change, DeepSpeedConfigError, Problem
from .callbacks import (
    ResolvedDeepSpeedConfigCallback,
    add_resolved_config_callback,
    fill_model_keys_on_trainer,
    reopen_step_keys,
    write_resolved_config,
)
from .load import PRESET_DIR, PRESETS, preset_path
from .resolve import (
    RESOLVED_CONFIG_NAME,
    Resolution,
    explain_deepspeed_config,
    fill_model_keys,
    load_deepspeed_config,
    resolve_deepspeed_config,
)

__all__ = [
    "PRESETS",
    "PRESET_DIR",
    "RESOLVED_CONFIG_NAME",
    "Change",
    "DeepSpeedConfigError",
    "Problem",
    "Resolution",
    "ResolvedDeepSpeedConfigCallback",
    "add_resolved_config_callback",
    "fill_model_keys_on_trainer",
    "explain_deepspeed_config",
    "fill_model_keys",
    "load_deepspeed_config",
    "preset_path",
    "reopen_step_keys",
    "resolve_deepspeed_config",
    "write_resolved_config",
]
