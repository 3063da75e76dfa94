"""ZeRO checkpoints as loadable weights: fp32 consolidation with DeepSpeed's own ``zero_to_fp32`` utilities (tied
weights stored once, which DeepSpeed's ``--safe_serialization`` cannot do), and ``Trainer.save_model`` for full models
under any ZeRO stage (:func:`save_trainer_model`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

from .. import atomic
from ..fsdp.engine import save_dtype as fsdp_save_dtype
from ..model_info import save_beside_weights, unwrapped_class
from ..peft import is_peft_model, save_adapter
from ..ranks import shared_outcome
from ..sizes import DEFAULT_MAX_SHARD_SIZE
from .writer import (
    TensorEntry,
    is_weight_file,
    model_entries,
    state_dict_entries,
    verify_saved_weights,
    write_entries,
)

logger = logging.getLogger(__name__)


def save_fp32_from_zero_checkpoint(
    checkpoint_dir: str | Path,
    output_dir: str | Path,
    model=None,
    *,
    tag: str | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Consolidate fp32 weights from the ZeRO checkpoint in ``checkpoint_dir`` (DeepSpeed's ``zero_to_fp32``) and
    write them to ``output_dir`` as safetensors, tied weights stored once. Single process; no engine needed.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415 (slow, probes the accelerator: only where a ZeRO checkpoint is read)

    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    written = write_entries(state_dict_entries(state_dict, model, dtype), output_dir, max_shard_size=max_shard_size)
    verify_saved_weights(output_dir, model)
    return written


def _engine(trainer):
    return trainer.model_wrapped if getattr(trainer, "is_deepspeed_enabled", False) else None


def gathers_16bit_weights(engine) -> bool:
    """Whether DeepSpeed gathers 16-bit weights at save time (ZeRO-3). Reads the engine's own parsed config, which
    understands every spelling DeepSpeed accepts — transformers and accelerate only know one of them."""
    return bool(engine.zero_gather_16bit_weights_on_model_save())


def save_model_files(trainer, model, output_dir: str | Path, stored_dtype: torch.dtype | None = None) -> None:
    """Everything but the weights, as ``save_pretrained`` + ``Trainer._save`` write it (main process only), with the
    model's own class and the dtype the weights are stored in recorded in ``config.json``."""
    config = getattr(model, "config", None)
    if config is not None:
        config.architectures = [unwrapped_class(model).__name__]
        if stored_dtype is not None:
            config.dtype = str(stored_dtype).split(".")[-1]
    save_beside_weights(output_dir, model, trainer.processing_class, trainer.args)


def _stored_dtype(entries: list[TensorEntry]) -> torch.dtype | None:
    floats = [e.dtype for e in entries if e.dtype.is_floating_point]
    return max(set(floats), key=floats.count) if floats else None


def save_trainer_model(trainer, output_dir: str | Path, *, checkpoint: bool = False) -> None:
    """``Trainer.save_model`` on every rank: a loadable ``output_dir`` whatever the ZeRO stage, written
    all-or-nothing (:mod:`hf_ext.atomic`): staged beside ``output_dir`` and swapped in once complete, so that
    ``output_dir`` holds the complete old save or the complete new one at every instant. A ``checkpoint`` is written
    straight into its directory, which the checkpoint save stages as a whole (:mod:`hf_ext.saving.checkpoints`).

    A failure on any rank raises on every rank (:mod:`hf_ext.ranks`).
    """
    if checkpoint:
        return _write_model(trainer, Path(output_dir), checkpoint=True)
    is_main = trainer.args.should_save
    with shared_outcome(f"preparing the save into {output_dir}"):
        staged = atomic.begin(output_dir) if is_main else atomic.staged_path(output_dir)
    try:
        _write_model(trainer, staged)
        with shared_outcome(f"swapping the save into {output_dir}"):
            if is_main:
                atomic.commit(output_dir, replaced=is_weight_file)
    except BaseException:
        if is_main:
            atomic.discard(output_dir)
        raise


def _write_model(trainer, output_dir: Path, *, checkpoint: bool = False) -> None:
    """What :func:`save_trainer_model` writes, into ``output_dir`` (fresh on the main rank):

    * PEFT: the adapter (:func:`hf_ext.peft.save_adapter`).
    * ZeRO-3 with 16-bit gathering on, ZeRO-1/2, FSDP2 and no engine: the streaming writer, a bounded group of
      parameters gathered at a time (FSDP2 under bf16/fp16 mixed precision writes that 16-bit dtype).
    * ZeRO-3 with gathering off: the final save writes a ZeRO checkpoint and consolidates fp32 weights from it;
      a mid-run ``checkpoint`` skips the weights (the ZeRO checkpoint the Trainer writes next holds them, and
      ``hf-ext export`` consolidates them).
    """
    args = trainer.args
    model = trainer.model
    if is_peft_model(model):
        return save_adapter(trainer, output_dir)
    is_main = args.should_save
    max_shard_size = args.save_max_shard_size
    engine = _engine(trainer)
    if engine is not None and engine.zero_optimization_partition_weights() and not gathers_16bit_weights(engine):
        if checkpoint and not args.save_only_model:
            with shared_outcome(f"writing the model files into {output_dir}"):
                if is_main:
                    save_model_files(trainer, model, output_dir)
            return
        with shared_outcome(f"writing a ZeRO checkpoint into {output_dir}"):
            engine.save_checkpoint(str(output_dir))
        with shared_outcome(f"consolidating fp32 weights in {output_dir}"):
            if is_main:
                logger.warning(
                    "16-bit gathering at save time is off in the DeepSpeed config: consolidating fp32 weights from "
                    f"the ZeRO checkpoint in {output_dir}. Set `stage3_gather_16bit_weights_on_model_save: true` to "
                    "save 16-bit weights directly."
                )
                save_fp32_from_zero_checkpoint(output_dir, output_dir, model, max_shard_size=max_shard_size)
                save_model_files(trainer, model, output_dir, torch.float32)
        return
    with shared_outcome(f"listing the tensors to save into {output_dir}"):  # each rank alone, then gathers together
        entries = model_entries(model, fsdp_save_dtype(trainer))
    write_entries(
        entries, output_dir, is_main=is_main, max_shard_size=max_shard_size, gather_bytes=args.save_gather_size
    )
    with shared_outcome(f"writing the model files into {output_dir}"):
        if is_main:
            verify_saved_weights(output_dir, model)
            save_model_files(trainer, model, output_dir, _stored_dtype(entries))


def handles(trainer) -> bool:
    """Whether :func:`save_trainer_model` saves this trainer's model (else the stock ``save_model`` does)."""
    if is_torch_xla_available() or is_sagemaker_mp_enabled():
        return False
    if getattr(trainer, "is_fsdp_enabled", False) and not trainer.accelerator.is_fsdp2:
        return False  # FSDP1's flat parameters: the stock path
    return hasattr(trainer.model, "config")  # arbitrary nn.Modules: the stock path
