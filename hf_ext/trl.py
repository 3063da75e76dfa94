"""hf-ext's features on TRL's trainers: ``SFTTrainer``, ``DPOTrainer`` and ``KTOTrainer`` with their configs.

Each class is TRL's own with :class:`hf_ext.TrainerMixin` / :class:`hf_ext.TrainingArgumentsMixin` in front, so
``deepspeed=`` takes a preset, a path or a dict with every ``"auto"`` resolved, the memory is planned, ZeRO-3 saves
stream 16-bit shards, PEFT checkpoints hold the adapter only and resume on any world size, and FSDP2 shards on CPU
ranks. ``SFTConfig`` also carries the generation eval's settings: an SFT evaluation on prompt-completion rows logs
``eval_bleu`` and ``eval_chrf`` of the completions. Needs ``pip install 'hf-ext[trl]'``.

What TRL needs beyond the plain Trainer (docs/trl.md):

* ``DPOTrainer`` and ``KTOTrainer`` start a DeepSpeed engine of their own for the reference model in ``__init__``,
  from the trainer's DeepSpeed config: hf-ext fills that config's model-dependent ``"auto"`` keys where the
  accelerator is created (``TrainerMixin.create_accelerator_and_postprocess``), before TRL copies it.
* TRL's configs decide ``bf16`` in their own ``__post_init__`` (on unless ``fp16``); hf-ext resolves the DeepSpeed
  config before that, so its default is applied first here: bf16 unless ``fp16`` where the hardware's default
  precision is bf16 (:meth:`hf_ext.runtime.Hardware.default_precision`), fp32 on a CPU, where bf16 autocast runs
  matmuls through torch's fallback kernel, many times slower (docs/benchmarks.md). ``bf16=True`` given is kept.
* TRL's trainers add a model card to every checkpoint in their ``_save_checkpoint``, which hf-ext's replaces: the
  card is written here, then hf-ext's atomic checkpoint.

``tests/unit/test_private_surface.py`` pins the TRL code these rely on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

try:
    import trl
except ImportError as err:  # an optional extra
    raise ImportError("hf_ext.trl needs TRL: pip install 'hf-ext[trl]'") from err

from transformers import AutoConfig

from .evaluation.settings import GenerationEvalArguments
from .runtime import Hardware
from .trainer import TrainerMixin
from .training_args import TrainingArgumentsMixin, args_doc

__all__ = ["DPOConfig", "DPOTrainer", "KTOConfig", "KTOTrainer", "SFTConfig", "SFTTrainer"]


class _TrlConfig(TrainingArgumentsMixin):
    def __post_init__(self):
        # the default (TRL's: bf16 unless fp16, on a CPU too), applied before hf-ext resolves the DeepSpeed config's
        # bf16 against it: the hardware's default precision (fp32 on a CPU, where bf16 autocast is far slower)
        if self.bf16 is None:
            self.bf16 = not self.fp16 and Hardware.detect(self.use_cpu).default_precision() == "bf16"
        # TRL's configs default the deprecated `gradient_checkpointing` to True: carried to its new name here, so
        # that transformers does not warn about a value the user never set
        if self.activation_checkpointing is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()


def _model_config(model):
    """The config of ``model``: a model's own, or, for a path or hub id (TRL loads those itself), its config file;
    ``None`` where none can be read (TRL then reports it)."""
    if not isinstance(model, (str, Path)):
        return getattr(model, "config", None)
    try:
        return AutoConfig.from_pretrained(str(model))
    except (OSError, ValueError):
        return None


class _TrlTrainer(TrainerMixin):
    collates_padding_free = False  # TRL's configs have padding_free, and TRL's collators implement it

    def __init__(self, model, *args, **kwargs):
        config = _model_config(model)
        if getattr(config, "is_encoder_decoder", False):
            name = model if isinstance(model, str) else type(model).__name__
            raise ValueError(
                f"{type(self).__name__} trains decoder-only models only (TRL {trl.__version__}), and {name} is an "
                "encoder-decoder. Fine-tune it with hf_ext.Seq2SeqTrainer on the chosen (or edited) replies: "
                "recipes/blenderbot.py does (docs/trl.md)."
            )
        super().__init__(model, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        # what TRL's own _save_checkpoint adds before the stock one: the model card, named after the run
        name = Path(self.args.output_dir).name if self.args.hub_model_id is None else self.args.hub_model_id
        self.create_model_card(model_name=name.split("/")[-1])
        super()._save_checkpoint(model, trial)


@dataclass
class SFTConfig(_TrlConfig, trl.SFTConfig, GenerationEvalArguments):
    __doc__ = args_doc(trl.SFTConfig, TrainingArgumentsMixin, GenerationEvalArguments)


@dataclass
class DPOConfig(_TrlConfig, trl.DPOConfig):
    __doc__ = args_doc(trl.DPOConfig, TrainingArgumentsMixin)


@dataclass
class KTOConfig(_TrlConfig, trl.KTOConfig):
    __doc__ = args_doc(trl.KTOConfig, TrainingArgumentsMixin)


class SFTTrainer(_TrlTrainer, trl.SFTTrainer):
    """:class:`trl.SFTTrainer` with hf-ext's features and, on prompt-completion rows, the BLEU eval."""

    args_class = SFTConfig


class DPOTrainer(_TrlTrainer, trl.DPOTrainer):
    """:class:`trl.DPOTrainer` with hf-ext's features; its reference model starts from the same resolved config."""

    args_class = DPOConfig


class KTOTrainer(_TrlTrainer, trl.KTOTrainer):
    """:class:`trl.KTOTrainer` with hf-ext's features; its reference model starts from the same resolved config."""

    args_class = KTOConfig
