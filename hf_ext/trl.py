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

One addition to a loss: ``KTOConfig(sft_weight=w)`` adds ``w`` times the NLL per token of the batch's desirable
completions to KTO's loss, as DPO's ``loss_type=["sigmoid", "sft"]`` adds the chosen replies' NLL to DPO's. KTO's own
loss only asks a desirable reply to be likelier than under the reference model and saturates once it is; the SFT
term keeps asking, so rows trained on to keep what the model knew (rehearsal) hold their likelihood.

``tests/unit/test_private_surface.py`` pins the TRL code these rely on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

try:
    import trl
except ImportError as err:  # an optional extra
    raise ImportError("hf_ext.trl needs TRL: pip install 'hf-ext[trl]'") from err

import torch
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
    __doc__ = (
        args_doc(trl.KTOConfig, TrainingArgumentsMixin)
        + """
        sft_weight (`float`, *optional*, defaults to `0.0`):
            Adds this weight times the NLL per token of the batch's desirable completions to KTO's loss (logged as
            `sft_loss`); 0 trains KTO's loss alone.
"""
    )

    sft_weight: float = field(
        default=0.0,
        metadata={
            "help": "Adds this weight times the NLL per token of the batch's desirable completions to KTO's loss "
            "(logged as sft_loss); 0 trains KTO's loss alone."
        },
    )

    def __post_init__(self):
        if self.sft_weight < 0:
            raise ValueError(f"sft_weight={self.sft_weight}: give 0 (KTO's loss alone) or a positive weight.")
        super().__post_init__()


class SFTTrainer(_TrlTrainer, trl.SFTTrainer):
    """:class:`trl.SFTTrainer` with hf-ext's features and, on prompt-completion rows, the BLEU eval."""

    args_class = SFTConfig


class DPOTrainer(_TrlTrainer, trl.DPOTrainer):
    """:class:`trl.DPOTrainer` with hf-ext's features; its reference model starts from the same resolved config."""

    args_class = DPOConfig


class KTOTrainer(_TrlTrainer, trl.KTOTrainer):
    """:class:`trl.KTOTrainer` with hf-ext's features; its reference model starts from the same resolved config."""

    args_class = KTOConfig

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not self.args.sft_weight:
            return result
        loss, outputs = result if return_outputs else (result, None)
        loss = loss + self.args.sft_weight * self._desirable_nll(model, inputs)
        return (loss, outputs) if return_outputs else loss

    def _desirable_nll(self, model, inputs) -> torch.Tensor:
        """The mean NLL per token of the desirable rows' completions in ``inputs`` (0 where the batch has none),
        through the fused LM head TRL's trainer gives the model. Every row goes through the forward, so that each
        rank runs the same modules whatever its labels (ZeRO-3 gathers parameters collectively in the forward)."""
        ids = inputs["input_ids"]
        desirable = torch.as_tensor(inputs["label"], dtype=torch.bool, device=ids.device)
        keep = (inputs["completion_mask"] != 0) & desirable[:, None]
        out = model(
            input_ids=ids,
            attention_mask=inputs["attention_mask"],
            labels=ids.masked_fill(~keep, -100),
            fused_lm_head=True,
            use_cache=False,
        )
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["sft_loss"].append(self.accelerator.gather_for_metrics(out.loss.detach()).mean().item())
        return out.loss
