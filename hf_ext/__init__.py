"""hf-ext: a Hugging Face Trainer extension for DeepSpeed fine-tuning.

One package per feature: ``deepspeed`` (config auto-filling, doctor), ``memory`` (planner), ``saving`` (streaming
16-bit saves, checkpoints, export), ``peft`` (adapter checkpoints), ``evaluation`` (BLEU), ``cli``; ``trainer`` and
``training_args`` switch them all on, through :class:`TrainerMixin` and :class:`TrainingArgumentsMixin`, which give the
same to any Trainer subclass (``hf_ext.trl``: TRL's trainers). Names below are imported on first use, so that ``import hf_ext`` stays light.
"""

from __future__ import annotations

from .lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "BleuEvalCallback": ".evaluation.bleu",
    "BleuEvalConfig": ".evaluation.bleu",
    "DeepSpeedConfigError": ".deepspeed",
    "PRESETS": ".deepspeed",
    "ResolvedDeepSpeedConfigCallback": ".deepspeed",
    "explain_deepspeed_config": ".deepspeed",
    "load_deepspeed_config": ".deepspeed",
    "resolve_deepspeed_config": ".deepspeed",
    "MemoryPlanCallback": ".memory.measure",
    "PREEMPTED_EXIT_CODE": ".preemption",
    "PreemptionCallback": ".preemption",
    "exit_if_preempted": ".preemption",
    "Seq2SeqTrainer": ".trainer",
    "Trainer": ".trainer",
    "TrainerMixin": ".trainer",
    "Seq2SeqTrainingArguments": ".training_args",
    "TrainingArguments": ".training_args",
    "TrainingArgumentsMixin": ".training_args",
    "end_distributed": ".runtime",
    "prepare_run": ".runtime",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
