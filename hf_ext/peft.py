"""PEFT-aware saving and checkpoints that resume on any number of ranks, with or without DeepSpeed.

* :func:`save_adapter` gathers the trainable parameters (adapters and ``modules_to_save``, full shapes even under
  ZeRO-3 and FSDP2 — PEFT alone can save ``[0]``-shaped tensors there, peft #2450) and writes them with
  ``PeftModel.save_pretrained``.
* :func:`save_trainable_state` writes, per trainable parameter *name*, its fp32 value and its full (un-partitioned)
  optimizer state, plus the optimizer step and the scheduler state: world-size-independent files whose size follows
  the adapter, not the base model. DeepSpeed's own ``safe_get_full_*`` utilities read the partitioned state,
  ``DTensor.full_tensor`` FSDP2's. The tensors go into a safetensors file, everything else into JSON: loading a
  checkpoint never unpickles anything.
* :func:`load_trainable_state` puts it back into a fresh trainer after its optimizer exists (any ZeRO stage, FSDP2,
  any world size, or no DeepSpeed).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import distribute_tensor

from .gather import full_values, gathered, is_dtensor, is_partitioned
from .model_info import save_beside_weights
from .ranks import shared_outcome
from .schedule import inner_scheduler

logger = logging.getLogger(__name__)

TRAINABLE_STATE_NAME = "hf_ext_trainable_state.safetensors"  # the tensors
TRAINABLE_STATE_META = "hf_ext_trainable_state.json"  # the rest, and which tensor is which
LEGACY_TRAINABLE_STATE_NAME = "hf_ext_trainable_state.pt"  # one pickled file (older hf-ext); read with weights_only
TRAINABLE_STATE_FORMAT = 2
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
OPTIMIZER_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def is_trainable_state_checkpoint(path) -> bool:
    if path is None or isinstance(path, bool):
        return False
    path = Path(path)
    written = (path / TRAINABLE_STATE_NAME).is_file() and (path / TRAINABLE_STATE_META).is_file()
    return written or (path / LEGACY_TRAINABLE_STATE_NAME).is_file()


def trainable_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def gathered_trainable_state_dict(model) -> dict[str, torch.Tensor]:
    """Full-shape CPU copies of the trainable parameters (call on every rank under ZeRO-3 and FSDP2)."""
    named = trainable_parameters(model)
    with full_values([p for _, p in named]) as values:
        return {name: value.detach().to("cpu", copy=True) for (name, _), value in zip(named, values)}


def save_adapter(trainer, output_dir: str | Path) -> None:
    """``save_model`` for a PEFT model, on every rank: the adapter (and ``modules_to_save``) with full shapes."""
    model = trainer.model
    state_dict = gathered_trainable_state_dict(model)
    with shared_outcome(f"writing the adapter into {output_dir}"):
        if trainer.args.should_save:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            model.save_pretrained(str(out), state_dict=state_dict, safe_serialization=True)
            verify_adapter(out)
            save_beside_weights(out, model.get_base_model(), trainer.processing_class, trainer.args, config=False)


def verify_adapter(output_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Refuse an adapter file that is missing, empty, or holds an empty or ``[0]``-shaped tensor."""
    path = Path(output_dir) / ADAPTER_FILES[0]
    if not path.is_file():
        raise RuntimeError(f"No {ADAPTER_FILES[0]} was written to {output_dir}.")
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    bad = [f"{k} has shape {list(s)}" for k, s in shapes.items() if 0 in s]
    if not shapes or bad:
        path.unlink()
        raise RuntimeError(
            f"Refusing the adapter saved in {output_dir}: {'; '.join(bad) or 'no tensors'}. Under ZeRO-3 the "
            "trainable parameters must be gathered before saving (hf_ext.peft.save_adapter does)."
        )
    return shapes


# ----------------------------------------------------------------------------------------------------------------
# trainable state: parameters, optimizer, scheduler — by name, full shapes
# ----------------------------------------------------------------------------------------------------------------


def _inner_optimizer(optimizer):
    """The torch optimizer that holds the state: unwraps accelerate's and DeepSpeed's wrappers."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _deepspeed_param(param) -> bool:
    return is_partitioned(param) or hasattr(param, "_hp_mapping")


def _optimizer_step(optimizer) -> int:
    for state in _inner_optimizer(optimizer).state.values():
        if "step" in state:
            step = state["step"]
            return int(step.item() if torch.is_tensor(step) else step)
    return 0


def _full_state(optimizer, param, key: str) -> torch.Tensor | None:
    if _deepspeed_param(param):
        from deepspeed.utils import safe_get_full_optimizer_state  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

        value = safe_get_full_optimizer_state(param, key)
    else:
        value = _inner_optimizer(optimizer).state.get(param, {}).get(key)
        if value is not None and is_dtensor(value):  # FSDP2: the state is sharded as its parameter (collective)
            value = value.full_tensor()
    return None if value is None else value.detach().to("cpu", copy=True)


def _full_fp32(param) -> torch.Tensor:
    if _deepspeed_param(param):
        from deepspeed.utils import safe_get_full_fp32_param  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

        value = safe_get_full_fp32_param(param)
        if value is not None:
            return value.detach().to("cpu", dtype=torch.float32, copy=True)
    with full_values([param]) as (value,):
        return value.detach().to("cpu", dtype=torch.float32, copy=True)


def save_trainable_state(trainer, output_dir: str | Path) -> None:
    """Write :data:`TRAINABLE_STATE_NAME` (every rank takes part in the gathers; the main process writes)."""
    model, optimizer, scheduler = trainer.model, trainer.optimizer, inner_scheduler(trainer.lr_scheduler)
    params = {}
    for name, param in trainable_parameters(model):
        entry = {"param": _full_fp32(param)}
        for key in OPTIMIZER_STATE_KEYS:
            value = _full_state(optimizer, param, key)
            if value is not None:
                entry[key] = value.reshape(entry["param"].shape)
        params[name] = entry
    state = {
        "params": params,
        "optimizer_step": _optimizer_step(optimizer),
        "scheduler_class": type(scheduler).__name__ if scheduler is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "global_step": trainer.state.global_step,
        "world_size": trainer.args.world_size,
    }
    if trainer.args.should_save:
        write_trainable_state(state, output_dir)


# ----------------------------------------------------------------------------------------------------------------
# the files: tensors in safetensors, the rest in JSON
# ----------------------------------------------------------------------------------------------------------------

_TENSOR_REF = "__tensor__"  # a JSON value {"__tensor__": key} stands for the tensor stored under key


def _to_json(value, where: str, tensors: dict[str, torch.Tensor]):
    """``value`` as JSON; its tensors moved into ``tensors`` (under ``where``) and referenced by key."""
    if torch.is_tensor(value):
        if where in tensors:
            raise ValueError(f"Two tensors of the trainable state are both named {where!r}.")
        tensors[where] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR_REF: where}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where} has a key that is not a string: hf-ext stores it as JSON, which has none.")
        return {k: _to_json(v, f"{where}.{k}", tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}.{i}", tensors) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"{where} is a {type(value).__qualname__}: hf-ext stores the trainable state as tensors and JSON only. "
        "Use a learning-rate scheduler whose state_dict holds numbers, strings, lists, dicts and tensors."
    )


def _from_json(value, tensors: dict[str, torch.Tensor]):
    if isinstance(value, dict):
        if set(value) == {_TENSOR_REF}:
            return tensors[value[_TENSOR_REF]]
        return {k: _from_json(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v, tensors) for v in value]
    return value


def write_trainable_state(state: dict, output_dir: str | Path) -> None:
    """Write ``state`` (``params``: name -> {``param``, ``exp_avg``, ``exp_avg_sq``} tensors; the rest numbers,
    strings, lists and dicts, tensors allowed) as :data:`TRAINABLE_STATE_NAME` and :data:`TRAINABLE_STATE_META`."""
    tensors: dict[str, torch.Tensor] = {}
    meta = {k: _to_json(v, k, tensors) for k, v in state.items()}
    meta["format"] = TRAINABLE_STATE_FORMAT
    out = Path(output_dir)
    save_file(tensors, str(out / TRAINABLE_STATE_NAME), metadata={"format": "pt"})
    (out / TRAINABLE_STATE_META).write_text(json.dumps(meta, indent=1) + "\n")


def read_trainable_state(checkpoint: str | Path) -> dict:
    """The state :func:`write_trainable_state` wrote into ``checkpoint`` (or an older hf-ext's pickled file, read
    with ``weights_only=True``), its tensors on the CPU."""
    path = Path(checkpoint)
    if not (path / TRAINABLE_STATE_META).is_file() and (path / LEGACY_TRAINABLE_STATE_NAME).is_file():
        return torch.load(path / LEGACY_TRAINABLE_STATE_NAME, map_location="cpu", weights_only=True)
    meta = json.loads((path / TRAINABLE_STATE_META).read_text())
    if meta.get("format") != TRAINABLE_STATE_FORMAT:
        raise ValueError(
            f"{path / TRAINABLE_STATE_META} has format {meta.get('format')!r}; this hf-ext reads format "
            f"{TRAINABLE_STATE_FORMAT}. Resume it with the hf-ext version that wrote it."
        )
    return _from_json(meta, load_file(str(path / TRAINABLE_STATE_NAME), device="cpu"))


def _ensure_optimizer_state(optimizer, step: int) -> None:
    """Create Adam-style state for every parameter the torch optimizer holds, so that it can be overwritten."""
    inner = _inner_optimizer(optimizer)
    holders = [p for group in inner.param_groups for p in group["params"]]
    wrapper = optimizer
    while getattr(wrapper, "optimizer", None) is not None and wrapper.optimizer is not inner:
        wrapper = wrapper.optimizer
    # DeepSpeed's flat fp32 partitions carry the state (ZeRO-3 / ZeRO-1/2), whatever param_groups say before a step
    for attr in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        holders += list(getattr(wrapper, attr, None) or [])
    for p in {id(p): p for p in holders}.values():
        state = inner.state[p]
        if "step" in state:
            state["step"] = torch.tensor(float(step)) if torch.is_tensor(state["step"]) else step
            continue
        state["step"] = torch.tensor(float(step))
        for key in OPTIMIZER_STATE_KEYS:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    # ZeRO-1/2 link each parameter's view of that state (what safe_set_full_optimizer_state writes through) at the
    # first step only: before one, link them now (a no-op once linked)
    link = getattr(wrapper, "_lazy_init_hp_params_optimizer_state", None)
    if callable(link):
        link()


def _copy_full(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target`` (a plain tensor, or an FSDP2 DTensor: each rank keeps its own shard of ``value``) = ``value``."""
    value = value.to(target.dtype).reshape(target.shape)
    if is_dtensor(target):
        value = distribute_tensor(value.to(target.device), target.device_mesh, target.placements)
    with torch.no_grad():
        target.copy_(value)


def _set_param(param, value: torch.Tensor) -> None:
    with gathered([param], modifier_rank=0):  # ZeRO-3: full-shaped inside, scattered back on exit
        _copy_full(param.data, value)
    if _deepspeed_param(param):
        from deepspeed.utils import safe_set_full_fp32_param  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

        safe_set_full_fp32_param(param, value.to(torch.float32))


def _set_state(optimizer, param, key: str, value: torch.Tensor) -> None:
    if _deepspeed_param(param):
        from deepspeed.utils import safe_set_full_optimizer_state  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

        safe_set_full_optimizer_state(param, value, key)
    else:
        _copy_full(_inner_optimizer(optimizer).state[param][key], value)


def load_trainable_state(trainer, checkpoint: str | Path) -> None:
    """Restore parameters, optimizer and scheduler from :func:`read_trainable_state` (every rank)."""
    model, optimizer, scheduler = trainer.model, trainer.optimizer, inner_scheduler(trainer.lr_scheduler)
    named = dict(trainable_parameters(model))
    with shared_outcome(f"reading {checkpoint}"):  # each rank reads it; the copies below gather under ZeRO-3
        state = read_trainable_state(checkpoint)
        missing = sorted(set(named) - set(state["params"]))
        unexpected = sorted(set(state["params"]) - set(named))
        if missing or unexpected:
            raise ValueError(
                f"{checkpoint} does not match the model's trainable parameters (missing: {missing[:5]}, unexpected: "
                f"{unexpected[:5]}). Resume with the same PEFT config it was written with."
            )
    _ensure_optimizer_state(optimizer, state["optimizer_step"])
    for name, param in named.items():
        entry = state["params"][name]
        _set_param(param, entry["param"])
        for key in OPTIMIZER_STATE_KEYS:
            if key in entry:
                _set_state(optimizer, param, key, entry[key])
    if scheduler is not None and state.get("scheduler") is not None:
        saved = state["scheduler"]
        same_groups = len(saved.get("base_lrs", ())) == len(getattr(scheduler, "base_lrs", ()))
        if type(scheduler).__name__ == state["scheduler_class"] and same_groups:
            scheduler.load_state_dict(saved)
        else:  # another schedule class, or other optimizer groups (DeepSpeed vs not): replay the steps
            logger.info(
                f"Scheduler {type(scheduler).__name__} cannot load the checkpoint's {state['scheduler_class']} state: "
                f"stepping it {state['optimizer_step']} times instead."
            )
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
                for _ in range(state["optimizer_step"]):
                    scheduler.step()
    logger.info(
        f"Resumed {len(named)} trainable tensors, optimizer step {state['optimizer_step']} from {checkpoint} "
        f"(written on {state['world_size']} rank(s), now {trainer.args.world_size})."
    )
