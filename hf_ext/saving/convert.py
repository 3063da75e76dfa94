"""A Trainer checkpoint from one engine to the other: ``hf-ext convert CHECKPOINT OUT --to fsdp2|deepspeed``.

The pivot is DeepSpeed's *universal* checkpoint: every parameter's fp32 value and optimizer moments whole, by name.

* ZeRO (stage 1, 2 or 3, any world size) -> FSDP2: DeepSpeed's own ``ds_to_universal`` makes the universal
  checkpoint (in a scratch directory beside ``OUT``); its tensors are written with ``torch.distributed.checkpoint``
  (DCP) in the layout accelerate's FSDP2 checkpoints have: ``pytorch_model_fsdp_0`` (``{"model": state_dict}``) and
  ``optimizer_0`` (``{"optimizer": ...}``, the state by parameter name). The tensors are whole: DCP cuts each rank's
  shard as it loads, on any number of ranks.
* FSDP2 -> DeepSpeed: the DCP state is read whole (``dcp_to_torch_save``) and written as a universal checkpoint
  (``global_stepN/zero/<parameter>/{fp32,exp_avg,exp_avg_sq,step}.pt``, ``zero/optimizer_state.pt``, the engine's
  metadata file and ``latest_universal``). hf-ext's DeepSpeed resume loads it with DeepSpeed's
  ``checkpoint.load_universal`` (:func:`hf_ext.saving.resume.plan_resume`), under ZeRO-1, 2 or 3, on any number of
  ranks.

Both keep the Trainer's own files as they are (trainer state, the Trainer's scheduler, RNG states, arguments, model
config): the step, the data position and the schedule go on. hf-ext's marker records the world size and batch that
wrote the state, so that the resume keeps the global batch.

The optimizer is Adam's (``exp_avg``, ``exp_avg_sq``, ``step``): what the Trainer and hf-ext's presets create. The
FSDP2 side gets the parameter groups the Trainer makes (weight decay on all but biases and norms, as
``Trainer.get_decay_parameter_names``); DeepSpeed reads each group's settings by position.

Refused in one line, before anything is written: a directory that is no DeepSpeed or FSDP2 checkpoint, a checkpoint
already of the asked engine, an adapter-only (PEFT) checkpoint (it resumes under any engine as it is), a checkpoint
whose learning-rate schedule lives in DeepSpeed's engine (the config's ``"scheduler"`` block: the Trainer has no
such schedule to continue under FSDP2), an FSDP2 checkpoint without hf-ext's marker (the world size and batch
that wrote it), an optimizer without Adam's state, and an ``OUT`` that exists.
``OUT`` is written all-or-nothing (:func:`hf_ext.atomic.atomic_directory`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import deepspeed
import torch
import torch.distributed.checkpoint as dcp
import transformers
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers.trainer import SCHEDULER_NAME

from ..atomic import atomic_directory, work_path
from ..model_info import random_init_model
from ..peft import is_trainable_state_checkpoint
from .checkpoints import CHECKPOINT_MARKER, TRAINER_STATE_NAME, write_marker
from .model_dir import DEEPSPEED_TAG_FILE
from .resume import (
    FSDP_MODEL_DIR,
    FSDP_OPTIMIZER_DIR,
    LATEST_UNIVERSAL,
    engine_of,
    read_marked_checkpoint,
    read_zero_checkpoint,
    run_ds_to_universal,
)

logger = logging.getLogger(__name__)

TARGETS = ("fsdp2", "deepspeed")
ADAM_STATES = ("exp_avg", "exp_avg_sq")
#: DeepSpeed's files that a converted checkpoint does not carry over
DEEPSPEED_ONLY = (DEEPSPEED_TAG_FILE, LATEST_UNIVERSAL, "zero_to_fp32.py", "zero_to_torch.py", CHECKPOINT_MARKER)


class ConvertError(ValueError):
    """A checkpoint ``hf-ext convert`` cannot convert; the message is the one line the user reads."""


def check_convertible(checkpoint: str | Path, out: str | Path, to: str) -> str:
    """The source engine of ``checkpoint``, or :class:`ConvertError` naming what cannot be converted and what to do."""
    checkpoint, out = Path(checkpoint), Path(out)
    if to not in TARGETS:
        raise ConvertError(f"--to {to}: choose one of {', '.join(TARGETS)}.")
    if not checkpoint.is_dir():
        raise ConvertError(f"{checkpoint} is not a directory: pass a checkpoint-N directory of a run.")
    if out.exists():
        raise ConvertError(f"{out} exists: pass a new directory for the converted checkpoint.")
    if is_trainable_state_checkpoint(checkpoint):
        raise ConvertError(
            f"{checkpoint} holds an adapter's trainable state by name: it resumes under any engine "
            "and world size as it is, no conversion needed."
        )
    source = engine_of(checkpoint)
    if source is None:
        raise ConvertError(
            f"{checkpoint} holds no DeepSpeed state ('{DEEPSPEED_TAG_FILE}' and global_stepN/) nor "
            f"FSDP2 state ({FSDP_MODEL_DIR}/): pass a checkpoint-N written by a DeepSpeed or FSDP2 "
            "run with its optimizer (not save_only_model)."
        )
    if source == to:
        raise ConvertError(
            f"{checkpoint} is already a {source} checkpoint: resume it as it is (on another number "
            "of ranks too: hf-ext reshards it as it loads)."
        )
    if not (checkpoint / TRAINER_STATE_NAME).is_file():
        raise ConvertError(f"{checkpoint} has no {TRAINER_STATE_NAME}: it is not a complete Trainer checkpoint.")
    if source == "deepspeed":
        zero = read_zero_checkpoint(checkpoint)
        if zero is None:
            raise ConvertError(
                f"{checkpoint} has no ZeRO optimizer partitions: only ZeRO stage 1, 2 or 3 checkpoints convert."
            )
        schedule = _deepspeed_scheduler(zero)
        if schedule is not None:
            raise ConvertError(
                f"{checkpoint}'s learning-rate schedule is DeepSpeed's {schedule} (the config's \"scheduler\" "
                "block), kept in its engine: the Trainer cannot continue it under FSDP2. Train with the Trainer's "
                'schedule (remove the "scheduler" block; --lr_scheduler_type sets it) to convert.'
            )
    elif not (checkpoint / FSDP_OPTIMIZER_DIR).is_dir():
        raise ConvertError(
            f"{checkpoint} has no {FSDP_OPTIMIZER_DIR}/: only an FSDP2 checkpoint with its sharded "
            "optimizer state (SHARDED_STATE_DICT) converts."
        )
    elif read_marked_checkpoint(checkpoint) is None:
        raise ConvertError(
            f"{checkpoint} has no hf-ext marker ({CHECKPOINT_MARKER}) saying the world size and batch "
            "that wrote it, which DeepSpeed's resume needs: resume it under hf-ext's FSDP2 and convert "
            "a checkpoint that run writes."
        )
    return source


def _deepspeed_scheduler(zero) -> str | None:
    """The DeepSpeed schedule (its config name) whose state the engine saved, or ``None``. The engine saves the
    Trainer's own scheduler too when the config has no ``"scheduler"`` block (transformers hands it to DeepSpeed):
    a ``LambdaLR`` state, with ``last_epoch``; DeepSpeed's schedules keep ``last_batch_iteration``."""
    states = _model_states(zero.path / zero.tag)
    schedule = states.get("lr_scheduler")
    if schedule is None or "last_epoch" in schedule:
        return None
    return ((states.get("ds_config") or {}).get("scheduler") or {}).get("type", "scheduler")


def _schedule_position(schedule: dict) -> dict:
    """The Trainer's scheduler state (``LambdaLR``) reduced to its position: the step it is at. What depends on the
    optimizer's parameter groups (``base_lrs``, ``_last_lr``, one function per group) is left to the optimizer that
    loads it, whose groups the engines make differently (DeepSpeed builds one group from a config's optimizer, the
    Trainer two); transformers' schedule functions keep no state, and the base learning rate is the run's. The last
    learning rate is kept for the first log line after the resume (the next step replaces it)."""
    keys = ("last_epoch", "_step_count", "_is_initial", "_get_lr_called_within_step", "_last_lr")
    return {**{k: schedule[k] for k in keys if k in schedule}, "lr_lambdas": []}


def _load(path: Path, mmap: bool = False):
    """``torch.load`` without unpickling code: tensors and plain containers, plus the two DeepSpeed classes its
    optimizer state pickles (its loss scaler and ZeRO stage enum), allowed by name."""
    with torch.serialization.safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum]):
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)


def _model_states(tag_folder: Path) -> dict:
    """DeepSpeed's engine metadata file of a tag (``mp_rank_00_model_states.pt``, under ZeRO-3 rank 0's)."""
    files = sorted(tag_folder.glob("*mp_rank_00_model_states.pt"))
    return _load(files[0], mmap=True)


def convert_checkpoint(checkpoint: str | Path, out: str | Path, to: str) -> Path:
    """Convert ``checkpoint`` into ``out`` for the engine ``to`` (see the module docstring); returns ``out``."""
    checkpoint, out = Path(checkpoint), Path(out)
    source = check_convertible(checkpoint, out, to)
    logger.info(f"Converting {checkpoint} ({source}) to {out} ({to})")
    with atomic_directory(out) as staged:
        work = work_path(out)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            if source == "deepspeed":
                written = _zero_to_fsdp2(checkpoint, staged, work)
            else:
                written = _fsdp2_to_universal(checkpoint, staged, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        _carry_trainer_files(checkpoint, staged)
        write_marker(staged, converted_from=source, **written)
    return out


def _carry_trainer_files(checkpoint: Path, staged: Path) -> None:
    """The Trainer's files (trainer state, scheduler, RNG, arguments, config, tokenizer, 16-bit weights): copied,
    unless the conversion wrote its own (the scheduler's)."""
    for path in sorted(checkpoint.iterdir()):
        if path.is_file() and path.name not in DEEPSPEED_ONLY and not (staged / path.name).exists():
            shutil.copy2(path, staged / path.name)


# ----------------------------------------------------------------------------------------------------------------
# ZeRO -> FSDP2
# ----------------------------------------------------------------------------------------------------------------


def _zero_to_fsdp2(checkpoint: Path, staged: Path, work: Path) -> dict:
    zero = read_zero_checkpoint(checkpoint)
    universal = work / zero.tag
    run_ds_to_universal(checkpoint / zero.tag, universal)
    states = _model_states(checkpoint / zero.tag)
    shapes = _parameter_shapes(states)
    params = _universal_tensors(universal / "zero", shapes)
    missing = [name for name, found in params.items() if found.get("exp_avg") is None and name in shapes]
    if missing:
        raise ConvertError(
            f"{checkpoint}'s optimizer keeps no Adam moments ({', '.join(ADAM_STATES)}) for "
            f"{missing[0]}: only Adam's state converts."
        )
    model = _model_state_dict(states, params)
    step = _adam_step(universal / "zero", params)
    groups = _trainer_param_groups(checkpoint, model, _source_groups(universal / "zero"))
    optimizer = {
        "state": {
            name: {"step": torch.tensor(float(step)), **{k: found[k] for k in ADAM_STATES}}
            for name, found in params.items()
            if found.get("exp_avg") is not None
        },
        "param_groups": groups,
    }
    if states.get("lr_scheduler") is not None:  # the Trainer's scheduler, which DeepSpeed's engine held and saved
        torch.save(_schedule_position(states["lr_scheduler"]), staged / SCHEDULER_NAME)
    dcp.save({"model": model}, storage_writer=dcp.FileSystemWriter(staged / FSDP_MODEL_DIR), no_dist=True)
    dcp.save({"optimizer": optimizer}, storage_writer=dcp.FileSystemWriter(staged / FSDP_OPTIMIZER_DIR), no_dist=True)
    config = states.get("ds_config") or {}
    return {
        "global_step": _global_step(checkpoint),
        "world_size": zero.world_size,
        "micro_batch": config.get("train_micro_batch_size_per_gpu"),
        "accumulation": config.get("gradient_accumulation_steps"),
    }


def _universal_tensors(zero_dir: Path, shapes: dict[str, torch.Size]) -> dict[str, dict]:
    """``name -> {"fp32": tensor, "exp_avg": tensor | None, "exp_avg_sq": tensor | None}`` of a universal
    checkpoint's ``zero/`` folder (a folder per parameter; buffers without optimizer state have ``fp32.pt`` only),
    each in its parameter's shape: ``ds_to_universal`` leaves a ZeRO-3 parameter's tensors flat (DeepSpeed's
    ZeRO-3 load partitions them flat), ZeRO-1/2's in their shape."""
    found = {}
    for folder in sorted(p for p in zero_dir.iterdir() if p.is_dir()):
        shape = shapes.get(folder.name)
        entry = {"fp32": _universal_tensor(folder / "fp32.pt", shape)}
        for key in ADAM_STATES:
            entry[key] = _universal_tensor(folder / f"{key}.pt", shape) if (folder / f"{key}.pt").is_file() else None
        found[folder.name] = entry
    return found


def _parameter_shapes(states: dict) -> dict[str, torch.Size]:
    """Each trained parameter's shape, as DeepSpeed's engine recorded it (``param_shapes``, one dict per group)."""
    return {name: torch.Size(shape) for group in states.get("param_shapes") or [] for name, shape in group.items()}


def _universal_tensor(path: Path, shape: torch.Size | None = None) -> torch.Tensor:
    loaded = _load(path)
    tensor = loaded["param"] if isinstance(loaded, dict) else loaded
    if shape is not None and tensor.shape != shape and tensor.numel() == shape.numel():
        tensor = tensor.view(shape)
    return tensor


def _model_state_dict(states: dict, params: dict[str, dict]) -> dict[str, torch.Tensor]:
    """Every key of the model's state dict, as ``model.state_dict()`` has them (tied names included): fp32 values
    from the universal checkpoint; a tied name takes its source's; a buffer its saved value."""
    module = states.get("module") or {}
    shared = states.get("shared_params") or {}
    out = {}
    for name in list(module) or list(params):
        if name in params:
            out[name] = params[name]["fp32"].contiguous()
        elif name in shared and shared[name] in params:
            out[name] = params[shared[name]]["fp32"].contiguous()
        else:
            out[name] = module[name].clone()
    for name in params:  # a parameter the module state lacked (ZeRO-3 keeps no module state for some)
        out.setdefault(name, params[name]["fp32"].contiguous())
    return out


def _adam_step(zero_dir: Path, params: dict[str, dict]) -> int:
    for name, found in params.items():
        if found.get("exp_avg") is not None and (zero_dir / name / "step.pt").is_file():
            step = _load(zero_dir / name / "step.pt")
            return int(step.item() if torch.is_tensor(step) else step)
    state = _load(zero_dir / "optimizer_state.pt")
    return int(state["optimizer_state_dict"]["state"][0]["step"])  # ZeRO-3 keeps it with the global state


def _source_groups(zero_dir: Path) -> list[dict]:
    """The source optimizer's parameter-group settings (lr, betas, eps, weight decay...), without their params."""
    state = _load(zero_dir / "optimizer_state.pt")
    groups = state.get("param_groups") or state["optimizer_state_dict"]["param_groups"]
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def _trainer_param_groups(checkpoint: Path, model_state: dict, source: list[dict]) -> list[dict]:
    """The Trainer's two groups (weight decay, none), as ``Trainer.create_optimizer`` makes them for this model,
    holding the parameters' names; settings from the source's first group (the decayed one when it had two)."""
    with torch.device("meta"):
        model = random_init_model(checkpoint)  # its config's architecture; no memory, no initialisation
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    unknown = sorted(set(names) - set(model_state))
    if unknown:
        raise ConvertError(f"{checkpoint}'s model config names a parameter its DeepSpeed state lacks ({unknown[0]}).")
    weight_decay = source[0].get("weight_decay", 0.0)
    return [
        {**source[0], "weight_decay": weight_decay, "params": [n for n in names if n in decay]},
        {**source[-1], "weight_decay": 0.0, "params": [n for n in names if n not in decay]},
    ]


def _global_step(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / TRAINER_STATE_NAME).read_text())["global_step"])


# ----------------------------------------------------------------------------------------------------------------
# FSDP2 -> DeepSpeed (universal)
# ----------------------------------------------------------------------------------------------------------------


def _read_dcp(folder: Path, work: Path) -> dict:
    """A DCP directory's whole content, in one process (torch's ``dcp_to_torch_save``, then loaded)."""
    file = work / f"{folder.name}.pt"
    dcp_to_torch_save(folder, file)
    loaded = _load(file)
    file.unlink()
    return loaded


def _fsdp2_to_universal(checkpoint: Path, staged: Path, work: Path) -> dict:
    model = _read_dcp(checkpoint / FSDP_MODEL_DIR, work)["model"]
    optimizer = _read_dcp(checkpoint / FSDP_OPTIMIZER_DIR, work)["optimizer"]
    state, groups = optimizer["state"], optimizer["param_groups"]
    lacking = [name for name, s in state.items() if any(k not in s for k in ADAM_STATES)]
    if lacking:
        raise ConvertError(
            f"{checkpoint}'s optimizer keeps no Adam moments ({', '.join(ADAM_STATES)}) for "
            f"{lacking[0]}: only Adam's state converts."
        )
    step = _global_step(checkpoint)
    adam_step = next((s["step"] for s in state.values() if "step" in s), torch.tensor(float(step)))
    tag = f"global_step{step}"
    zero = staged / tag / "zero"
    trainable = [name for group in groups for name in group["params"]]
    for name in trainable:  # DeepSpeed loads a folder per parameter it trains (its named_parameters' names)
        folder = zero / name
        folder.mkdir(parents=True)
        torch.save({"param": model[name].float()}, folder / "fp32.pt")
        moments = state.get(name) or {k: torch.zeros_like(model[name], dtype=torch.float32) for k in ADAM_STATES}
        for key in ADAM_STATES:
            torch.save({"param": moments[key].float()}, folder / f"{key}.pt")
        torch.save(moments.get("step", adam_step), folder / "step.pt")
    settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    # ZeRO-1/2 read "param_groups" and the version; ZeRO-3 reads its step and settings under "optimizer_state_dict"
    torch.save(
        {
            "ds_version": deepspeed.__version__,
            "param_groups": settings,
            "optimizer_state_dict": {"state": {0: {"step": adam_step}}, "param_groups": settings},
        },
        zero / "optimizer_state.pt",
    )
    written = read_marked_checkpoint(checkpoint)  # present: check_convertible
    schedule = (
        _schedule_position(_load(checkpoint / SCHEDULER_NAME)) if (checkpoint / SCHEDULER_NAME).is_file() else {}
    )
    # the engine's metadata: what DeepSpeed's universal load reads of it (the weights come from zero/). Its
    # scheduler gets the Trainer's position (transformers hands the Trainer's scheduler to the engine when the config
    # has no "scheduler" block), plus last_batch_iteration for DeepSpeed's own schedules (each reads its own keys)
    metadata = {
        "module": {},
        "dp_world_size": written.world_size,
        "mp_world_size": 1,
        "global_steps": step,
        "skipped_steps": 0,
        "global_samples": step * written.train_batch_size,
        "lr_scheduler": {**schedule, "last_batch_iteration": step - 1},
        "ds_version": deepspeed.__version__,
        "ds_config": {
            "train_batch_size": written.train_batch_size,
            "train_micro_batch_size_per_gpu": written.micro_batch,
            "gradient_accumulation_steps": written.accumulation,
        },
        "param_shapes": [{name: model[name].shape for name in group["params"]} for group in groups],
        "buffer_names": [name for name in model if name not in set(trainable)],
    }
    torch.save(metadata, staged / tag / "mp_rank_00_model_states.pt")
    if schedule:  # its position only, as the engine gets it
        torch.save(schedule, staged / SCHEDULER_NAME)
    os.link(staged / tag / "mp_rank_00_model_states.pt", staged / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (staged / LATEST_UNIVERSAL).write_text(tag)
    return {
        "global_step": step,
        "world_size": written.world_size,
        "micro_batch": written.micro_batch,
        "accumulation": written.accumulation,
    }
