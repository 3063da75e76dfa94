"""FSDP2 on every host: what the trainer does once its ``Accelerator`` exists.

accelerate turns its FSDP plugin on only for accelerator types (``MULTI_GPU``, ``MULTI_XPU``...). On a CPU-only host
the state is ``MULTI_CPU``, the plugin is dropped without a word, and ``--fsdp full_shard`` trains plain DDP. Torch's
FSDP2 (``fully_shard``) itself runs on CPU with gloo, so :func:`enable_on_trainer` switches the state to FSDP with the
plugin the arguments (or ``accelerate launch``'s FSDP settings) asked for, then sets up hybrid sharding's 2-D device
mesh (replicas × shard groups) when :mod:`hf_ext.fsdp.config` resolved one.
"""

from __future__ import annotations

import logging
import os

import torch
from accelerate import ParallelismConfig
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, fsdp2_prepare_model
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from ..errors import FsdpConfigError
from ..model_info import layer_classes
from .config import FSDP1_ON_CPU

logger = logging.getLogger(__name__)


def _requested_plugin(trainer):
    """The FSDP plugin the arguments or ``accelerate launch`` asked for (``None``: no FSDP)."""
    state = trainer.accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is not None:
        return plugin
    if trainer.args.fsdp_plugin_args is not None:
        return FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return FullyShardedDataParallelPlugin()  # accelerate launch's FSDP_* variables
    return None


def enable_on_trainer(trainer) -> None:
    """Make the FSDP the arguments ask for real: on CPU ranks, and with hybrid sharding's device mesh."""
    state = trainer.accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU and (plugin := _requested_plugin(trainer)) is not None:
        if plugin.fsdp_version != 2:
            raise FsdpConfigError([FSDP1_ON_CPU])
        if state.mixed_precision != "no":
            plugin.set_mixed_precision(state.mixed_precision)
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        # as AcceleratorState.__init__ ends: the process state learns the type too (each AcceleratorState() copies it)
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        trainer.is_fsdp_enabled = True
        logger.info("FSDP2 on CPU ranks (gloo): accelerate would have run DDP here.")
    resolution = getattr(trainer.args, "fsdp_resolution", None)
    if trainer.is_fsdp_enabled and resolution is not None and resolution.hybrid and state.parallelism_config is None:
        config = ParallelismConfig(dp_replicate_size=resolution.replicas, dp_shard_size=resolution.sharding_factor)
        state.parallelism_config = config
        state.device_mesh = config.get_device_mesh(trainer.accelerator.device.type)
        config._validate_accelerator(trainer.accelerator)
        logger.info(
            f"Hybrid sharding: each parameter split over {resolution.sharding_factor} ranks, "
            f"{resolution.replicas} replicas of each shard."
        )
    if trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2 and trainer.model is not None:
        wrap_repeated_layers(state.fsdp_plugin, trainer.model)
        shard_tied_group(trainer.accelerator, trainer.model)


def save_dtype(trainer):
    """The dtype FSDP2 computes in under bf16/fp16 mixed precision, which its save writes (as DeepSpeed's bf16/fp16
    engines save their 16-bit weights); ``None`` (the parameters' own dtype) otherwise. The fp32 master weights stay
    in the checkpoints' sharded state (``pytorch_model_fsdp_0``), which a resume reads."""
    if not (getattr(trainer, "is_fsdp_enabled", False) and trainer.accelerator.is_fsdp2):
        return None
    dtype = getattr(trainer.accelerator.state.fsdp_plugin.mixed_precision_policy, "param_dtype", None)
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def shard_for_evaluation(trainer) -> None:
    """An evaluation (or prediction) before any training under FSDP2: shard the model as ``train()`` will.

    Stock ``evaluation_loop`` passes the model alone to ``Accelerator.prepare``, which refuses FSDP2 without an
    optimizer ("a model and optimizer must be passed together"). Sharded here with accelerate's own
    ``fsdp2_prepare_model``, a later ``train()`` finds it sharded and accelerate only maps the optimizer onto its
    parameters (after :func:`hf_ext.gather.reshard`).
    """
    if not (trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2) or isinstance(trainer.model, FSDPModule):
        return
    model = fsdp2_prepare_model(trainer.accelerator, trainer.model)
    trainer.accelerator._models.append(model)  # what prepare() records; stock evaluation_loop reads it
    trainer.model = trainer.model_wrapped = model
    logger.info("Evaluating before training under FSDP2: the model is sharded now, as training would shard it.")


def wrap_repeated_layers(plugin, model) -> None:
    """Shard the model's repeated layers one by one when it declares no ``_no_split_modules`` (BlenderBot,
    DeBERTa-v2): accelerate's transformer-based wrapping then wraps nothing, and the whole model is one unit, gathered
    whole for every forward and backward (FSDP then saves nothing during compute)."""
    policy = getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy)
    transformer_based = policy is transformer_auto_wrap_policy or str(policy).upper() == "TRANSFORMER_BASED_WRAP"
    if not transformer_based or plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None):
        return
    names = layer_classes(model)
    if names:
        plugin.transformer_cls_names_to_wrap = names
        logger.info(
            f"FSDP2: {type(model).__name__} declares no _no_split_modules; sharding its layers one by one: "
            f"{', '.join(names)}."
        )


def tied_holders(model) -> list:
    """Modules that hold a parameter another module holds too, when accelerate's FSDP2 grouping would split them.

    accelerate puts the input and output embeddings (and the final norm) in one FSDP group when their weights are tied;
    an encoder-decoder model (BART, BlenderBot, T5) also ties its encoder's and decoder's ``embed_tokens`` to the same
    weight, which then lands in the root group as well and torch refuses the split ("shared with a parameter already
    managed by another FSDP group"). Empty when the embeddings are the only holders.
    """
    holders: dict[int, list] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), [])
            if module not in holders[id(param)]:
                holders[id(param)].append(module)
    shared = [modules for modules in holders.values() if len(modules) > 1]
    embeddings = {
        id(getattr(model, name, lambda: None)()) for name in ("get_input_embeddings", "get_output_embeddings")
    }
    if all(id(m) in embeddings for modules in shared for m in modules):
        return []
    out: list = []
    for modules in shared:
        out += [m for m in modules if m not in out]
    return out


def shard_tied_group(accelerator, model) -> None:
    """Put every holder of a shared parameter in one FSDP2 group before accelerate wraps the rest (see
    :func:`tied_holders`), with the plugin's settings; kept gathered from forward to backward, as accelerate keeps
    its own tied group."""
    modules = [m for m in tied_holders(model) if not isinstance(m, FSDPModule)]
    if not modules:
        return
    plugin = accelerator.state.fsdp_plugin
    if accelerator.mixed_precision != "no":  # fp32 master weights, as accelerate upcasts before sharding
        for module in modules:
            for param in module.parameters(recurse=False):
                if param.requires_grad and param.dtype != torch.float32:
                    param.data = param.data.to(torch.float32)
    mesh = accelerator.torch_device_mesh
    pc = accelerator.parallelism_config
    fully_shard(
        modules,
        reshard_after_forward=False,
        offload_policy=plugin.cpu_offload,
        mp_policy=plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        mesh=mesh[tuple(pc.fsdp_dim_names)] if mesh is not None and pc is not None else None,
    )
    logger.info(f"FSDP2: one group for the {len(modules)} modules that share a tied weight.")
