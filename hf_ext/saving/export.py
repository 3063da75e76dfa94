"""Serving-ready models from a training run (``hf-ext export``).

The source is a run's ``output_dir`` or one of its checkpoints, holding any of:

* a full-model save (safetensors / sharded safetensors / ``pytorch_model.bin``), e.g. hf-ext's 16-bit save;
* a ZeRO checkpoint only (``latest`` + ``global_step*``): fp32 weights are consolidated with DeepSpeed's
  ``zero_to_fp32`` utilities (tied weights handled);
* a PEFT adapter (``adapter_config.json``): written as an adapter, or merged into its base model with ``merge``.

A run directory without weights of its own is exported from its newest complete checkpoint. The output holds the
weights (safetensors), ``config.json``, ``generation_config.json`` and the tokenizer when one is found.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
from peft import PeftConfig, PeftModel
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ..atomic import atomic_directory, work_path
from ..model_info import base_model_of, model_class, save_beside_weights
from ..sizes import DEFAULT_MAX_SHARD_SIZE, SAVE_DTYPES
from .checkpoints import last_complete_checkpoint
from .model_dir import model_dir_kind
from .writer import is_weight_file, verify_saved_weights
from .zero import save_fp32_from_zero_checkpoint

logger = logging.getLogger(__name__)


def resolve_source(src: str | Path) -> tuple[Path, str]:
    """The directory to export from and its kind; a run directory falls back to its newest complete checkpoint."""
    src = Path(src)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    kind = model_dir_kind(src)
    if kind is None:
        checkpoint = last_complete_checkpoint(src)
        if checkpoint is not None and model_dir_kind(checkpoint) is not None:
            return Path(checkpoint), model_dir_kind(checkpoint)
        raise FileNotFoundError(
            f"Nothing to export in {src}: no model weights, ZeRO checkpoint, adapter or complete checkpoint-N."
        )
    return src, kind


def _dtype(name: str | None):
    return getattr(torch, SAVE_DTYPES[name]) if name else None


def _load_tokenizer(*candidates):
    for candidate in candidates:
        if candidate is None:
            continue
        files = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "spiece.model", "tokenizer.model")
        if Path(candidate).is_dir() and not any((Path(candidate) / name).is_file() for name in files):
            continue  # transformers would build a default tokenizer from config.json alone
        try:
            return AutoTokenizer.from_pretrained(str(candidate))
        except (OSError, ValueError, TypeError):
            continue
    return None


def _load_full_model(src: Path, kind: str, dtype, workdir: Path):
    """A full model from a weights directory or (consolidating fp32 weights first) a ZeRO checkpoint."""
    config = AutoConfig.from_pretrained(str(src))
    cls = model_class(config)
    weights_dir = src
    if kind == "zero":
        with torch.device("meta"):
            skeleton = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
        save_fp32_from_zero_checkpoint(src, workdir, skeleton)
        config.save_pretrained(workdir)
        weights_dir = workdir
    kwargs = {"dtype": dtype} if dtype is not None else {"dtype": "auto"}
    return cls.from_pretrained(str(weights_dir), **kwargs)


def _attach_generation_config(model, *dirs) -> None:
    for directory in dirs:
        if directory is not None and (Path(directory) / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(directory))
            return


def export(
    src: str | Path,
    out: str | Path,
    *,
    merge: bool = False,
    dtype: str | None = None,
    base_model: str | None = None,
    max_shard_size: str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Export ``src`` (see the module docstring) to ``out``; returns ``out``."""
    src, kind = resolve_source(src)
    out = Path(out)
    torch_dtype = _dtype(dtype)
    logger.info(f"Exporting {src} ({kind}) to {out}")
    # all-or-nothing: everything is written into a staging directory beside `out` and swapped in once complete
    with atomic_directory(out, replaced=is_weight_file) as staged:
        workdir = work_path(out)
        workdir.mkdir()
        try:
            model, base_dir = _load(src, kind, merge, torch_dtype, base_model, workdir)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        target = base_model_of(model)
        _attach_generation_config(target, src, src.parent, base_dir)
        model.save_pretrained(str(staged), max_shard_size=max_shard_size)
        tokenizer = _load_tokenizer(src, src.parent, base_dir)
        if tokenizer is None:
            logger.warning(f"No tokenizer found next to {src}; the export has none.")
        # an unmerged adapter's serving side also needs the base's configs
        save_beside_weights(staged, target, tokenizer, config=hasattr(model, "peft_config"))
        if not hasattr(model, "peft_config"):
            verify_saved_weights(staged, model)
    return out


def export_gguf(src: str | Path, out: str | Path, kind: str = "f16", *, base_model: str | None = None) -> Path:
    """Export ``src`` (see the module docstring; an adapter is merged into its base) as one GGUF file ``out`` of type
    ``kind`` (:data:`hf_ext.saving.gguf.GGUF_TYPES`) with its tokenizer, chat template and generation defaults,
    all-or-nothing; returns ``out``."""
    import tempfile  # noqa: PLC0415 (the gguf package: an extra)

    from .gguf import GGUFError, write_gguf  # noqa: PLC0415 (the gguf package: an extra)

    src, source_kind = resolve_source(src)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info(f"Exporting {src} ({source_kind}) to {out} (GGUF {kind.upper()})")
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.load-", dir=out.parent) as workdir:
        model, base_dir = _load(src, source_kind, True, torch.float32, base_model, Path(workdir))
    _attach_generation_config(model, src, src.parent, base_dir)
    tokenizer = _load_tokenizer(src, src.parent, base_dir)
    if tokenizer is None:
        raise GGUFError(f"A GGUF file carries its tokenizer; none was found next to {src} or its base model.")
    return write_gguf(model, tokenizer, out, kind, name=src.name if src.name != "final" else src.parent.name)


def _load(src: Path, kind: str, merge: bool, torch_dtype, base_model: str | None, workdir: Path):
    """The model to export (and an adapter's base directory)."""
    if kind != "adapter":
        return _load_full_model(src, kind, torch_dtype, workdir), None
    peft_config = PeftConfig.from_pretrained(str(src))
    base_dir = base_model or peft_config.base_model_name_or_path
    base_kind = model_dir_kind(base_dir) if Path(base_dir).is_dir() else "model"
    base = _load_full_model(Path(base_dir), base_kind or "model", torch_dtype, workdir)
    model = PeftModel.from_pretrained(base, str(src))
    if merge:
        model = model.merge_and_unload()
    elif torch_dtype is not None:
        model = model.to(torch_dtype)
    return model, base_dir
