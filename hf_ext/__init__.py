"""hf-ext: a Hugging Face Trainer extension for DeepSpeed fine-tuning.

Names are imported on first use, so that light users (the Chat-E app, ``hf_ext.dialogue``) do not pay for importing
transformers' Trainer and DeepSpeed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "BleuEvalCallback": ".bleu_eval",
    "BleuEvalConfig": ".bleu_eval",
    "DeepSpeedConfigError": ".deepspeed_config",
    "PRESETS": ".deepspeed_config",
    "ResolvedDeepSpeedConfigCallback": ".deepspeed_config",
    "explain_deepspeed_config": ".deepspeed_config",
    "load_deepspeed_config": ".deepspeed_config",
    "resolve_deepspeed_config": ".deepspeed_config",
    "Seq2SeqTrainer": ".trainer",
    "Trainer": ".trainer",
    "Seq2SeqTrainingArguments": ".training_args",
    "TrainingArguments": ".training_args",
    "end_distributed": ".runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_ext' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
