"""hf-ext: a Hugging Face Trainer extension for DeepSpeed fine-tuning."""

from .bleu_eval import BleuEvalCallback, BleuEvalConfig
from .deepspeed_config import (
    PRESETS,
    DeepSpeedConfigError,
    ResolvedDeepSpeedConfigCallback,
    explain_deepspeed_config,
    load_deepspeed_config,
    resolve_deepspeed_config,
)
from .trainer import Seq2SeqTrainer, Trainer
from .training_args import Seq2SeqTrainingArguments, TrainingArguments

__version__ = "0.1.0"

__all__ = [
    "BleuEvalCallback",
    "BleuEvalConfig",
    "DeepSpeedConfigError",
    "PRESETS",
    "ResolvedDeepSpeedConfigCallback",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Trainer",
    "TrainingArguments",
    "explain_deepspeed_config",
    "load_deepspeed_config",
    "resolve_deepspeed_config",
]
