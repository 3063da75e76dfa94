"""What hf-ext reads off a model or its config: the hidden size, the bucket sizes DeepSpeed derives from it, and the
model class an architecture name stands for. One place for each rule (config resolution, the memory planner and
export all ask here)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from torch.distributed.fsdp import FSDPModule
from transformers import AutoConfig, PretrainedConfig


def base_model_of(model):
    """The transformers model inside a PEFT wrapper (``get_base_model()``), else ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def hidden_size_of(model) -> int | None:
    """The hidden size transformers uses for the bucket sizes: ``hidden_size``, else ``max(hidden_sizes)``, also in
    ``text_config``. ``model`` is a model, a config, or a path / hub id."""
    if isinstance(model, (str, Path)):
        model = AutoConfig.from_pretrained(str(model))
    config = getattr(model, "config", model)
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


#: ZeRO keys transformers derives from the hidden size h when they are "auto": (value, formula) per key
def hidden_size_buckets(hidden: int) -> dict[str, tuple[int, str]]:
    """``{zero_optimization key: (integer value, formula)}`` for hidden size ``hidden`` (integers: DeepSpeed refuses
    floats)."""
    return {
        "reduce_bucket_size": (hidden * hidden, f"hidden_size^2 (h={hidden})"),
        "stage3_prefetch_bucket_size": (int(0.9 * hidden * hidden), f"int(0.9 x hidden_size^2) (h={hidden})"),
        "stage3_param_persistence_threshold": (10 * hidden, f"10 x hidden_size (h={hidden})"),
    }


def model_class(config):
    """The transformers class named by ``config.architectures`` (first one transformers has), else ``AutoModel``."""
    for name in getattr(config, "architectures", None) or ():
        if hasattr(transformers, name):
            return getattr(transformers, name)
    return transformers.AutoModel


def is_sequence_classifier(model) -> bool:
    """Whether ``model`` (a transformers ``...ForSequenceClassification``) takes one class id per example as labels."""
    return "ForSequenceClassification" in type(model).__name__


def random_init_model(model_or_config, seed: int = 0):
    """A random-init model of the architecture ``model_or_config`` names (a config, a path or a hub id; only the
    config is read)."""
    config = (
        model_or_config
        if isinstance(model_or_config, PretrainedConfig)
        else AutoConfig.from_pretrained(str(model_or_config))
    )
    cls = model_class(config)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return cls.from_config(config) if cls is __import__("transformers").AutoModel else cls._from_config(config)


def layer_classes(model) -> list[str]:
    """Names of the classes of a model's repeated layers (what FSDP shards one at a time): its ``_no_split_modules``
    when it declares them, else the element class of every ``nn.ModuleList`` holding two or more modules of one class
    with parameters (BlenderBot's and DeBERTa-v2's layers: their models declare none, and accelerate then wraps the
    whole model as one unit, gathered whole for every forward and backward)."""
    declared = list(getattr(model, "_no_split_modules", None) or ())
    if declared:
        return declared
    found: list[str] = []
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and any(True for _ in module[0].parameters()):
            name = type(module[0]).__name__
            if name not in found:
                found.append(name)
    return found


def layer_sizes(model) -> list[int]:
    """Parameters of each outermost layer of :func:`layer_classes` (FSDP's wrapping units)."""
    names = set(layer_classes(model))
    sizes, inside = [], None
    for prefix, module in model.named_modules():
        if inside is not None and prefix.startswith(inside):
            continue
        if type(module).__name__ in names:
            inside = prefix + "."
            sizes.append(sum(p.numel() for p in module.parameters()))
    return sizes


#: what ``Trainer._save`` names the pickled arguments beside a model's weights
TRAINING_ARGS_NAME = "training_args.bin"


def unwrapped_class(model) -> type:
    """The model's own class: FSDP2 makes ``FSDP<Name>`` classes deriving from ``FSDPModule`` and the model's."""
    cls = type(model)
    if issubclass(cls, FSDPModule):
        return next(base for base in cls.__bases__ if not issubclass(base, FSDPModule))
    return cls


def save_beside_weights(out, model, processing_class=None, training_args=None, config: bool = True) -> None:
    """The files a model directory holds beside its weights, as ``save_pretrained`` and ``Trainer._save`` write them:
    ``config.json`` (``config=False``: an adapter directory has its own), ``generation_config.json`` for a model that
    generates, the tokenizer's (or processor's) files, and ``training_args.bin`` (when ``training_args`` are given)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if config and getattr(model, "config", None) is not None:
        model.config.save_pretrained(out)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(out)
    if processing_class is not None:
        processing_class.save_pretrained(out)
    if training_args is not None:
        torch.save(training_args, out / TRAINING_ARGS_NAME)
