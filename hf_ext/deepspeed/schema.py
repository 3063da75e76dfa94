"""What DeepSpeed itself accepts, read from its own config models: known keys, field types, validation messages.

Nothing here is a hand-written copy of DeepSpeed's schema: sections are checked by DeepSpeed's pydantic models
(``DeepSpeedZeroConfig``, ``DeepSpeedFP16Config``, ...), and the known top-level keys are the ones
``deepspeed.runtime.config.DeepSpeedConfig`` looks up while parsing a config.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import inspect
import io
import re
import typing

from pydantic import BaseModel, ValidationError

from ..errors import short

# Sections that DeepSpeedConfig reads through helpers that never touch the top-level dict by key, or that the engine
# reads later (``engine._config._param_dict``): known to DeepSpeed even though parsing a minimal config skips them.
_SECTIONS_READ_ELSEWHERE = (
    "activation_checkpointing",
    "aio",
    "autotuning",
    "flops_profiler",
    "optimizer",
    "scheduler",
    "sequence_parallel_size",
    "zero_optimization",
)


@contextlib.contextmanager
def _deepspeed_quiet():
    """DeepSpeed logs a line per config parse and prints; keep ``hf-ext`` output to what the user asked for.
    (``Logger.disabled``, not ``setLevel``: the latter clears every logger's cache, slow when called per key.)"""
    from deepspeed.utils import logger as ds_logger  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    disabled = ds_logger.disabled
    ds_logger.disabled = True
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        ds_logger.disabled = disabled


class _RecordingDict(dict):
    """A dict that remembers every key looked up in it (``get``, ``in``, ``[]``, ``keys()``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set()

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def keys(self):
        outer = self

        class _Keys:
            def __contains__(self, key):
                outer.seen.add(key)
                return dict.__contains__(outer, key)

            def __iter__(self):
                return iter(dict.keys(outer))

        return _Keys()

    def __copy__(self):
        return self


@functools.cache
def known_top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed's ``DeepSpeedConfig`` looks up when it parses a config."""
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    probe = _RecordingDict(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    with _deepspeed_quiet():
        DeepSpeedConfig(probe)
    return frozenset(k for k in probe.seen if isinstance(k, str)) | frozenset(_SECTIONS_READ_ELSEWHERE)


@functools.cache
def section_models() -> dict[str, type]:
    """DeepSpeed's pydantic model for each section it validates strictly (unknown keys there are errors)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    return {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config}


def field_names(model: type) -> set[str]:
    """A pydantic model's accepted keys: field names and their aliases."""
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def _field_model(annotation) -> type | None:
    """The nested pydantic model of a field annotation (``Optional[Model]`` included), if any."""
    candidates = typing.get_args(annotation) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _is_type(annotation, wanted: type) -> bool:
    candidates = typing.get_args(annotation) or (annotation,)
    return any(c is wanted for c in candidates)


@functools.cache
def typed_fields(kind: str) -> frozenset[str]:
    """Dotted paths (aliases included) of the ``int``, ``float`` or ``bool`` (``kind``) fields of the strict
    sections."""
    wanted = {"int": int, "bool": bool, "float": float}[kind]
    paths: set[str] = set()

    def walk(model: type, prefix: str):
        for name, info in model.model_fields.items():
            keys = {name} | ({info.alias} if info.alias else set())
            nested = _field_model(info.annotation)
            if nested is not None:
                for key in keys:
                    walk(nested, f"{prefix}{key}.")
            elif _is_type(info.annotation, wanted) and not (wanted is int and _is_type(info.annotation, bool)):
                paths.update(f"{prefix}{key}" for key in keys)

    for section, model in section_models().items():
        walk(model, f"{section}.")
    if kind == "int":
        paths.update(
            {
                "zero_optimization.stage",
                "train_batch_size",
                "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps",
                "steps_per_print",
                "scheduler.params.warmup_num_steps",
                "scheduler.params.total_num_steps",
            }
        )
    return frozenset(paths)


@functools.cache
def zero_keys() -> frozenset[str]:
    """Keys that belong inside ``zero_optimization`` (and mean something else nowhere at top level)."""
    return frozenset(field_names(section_models()["zero_optimization"]) - known_top_level_keys())


# ZeRO knobs that only stage 3 reads (DeepSpeed documents them as "used by ZeRO3 / ZeRO-Infinity").
STAGE3_ONLY_KEYS = (
    "offload_param",
    "sub_group_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "zero_hpz_partition_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
)


def closest(key, choices) -> str | None:
    """The known name ``key`` most likely misspells: the same words in another order (``comm_overlap`` for
    ``overlap_comm``), else the closest spelling; ``None`` when nothing is close."""
    choices = sorted(str(c) for c in choices)
    words = sorted(str(key).lower().split("_"))
    same_words = [c for c in choices if sorted(c.lower().split("_")) == words and c != key]
    if same_words:
        return same_words[0]
    close = difflib.get_close_matches(str(key).lower(), choices, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(key: str, choices) -> str:
    close = closest(key, choices)
    return f" (did you mean {close!r}?)" if close else ""


def unknown_key_fix(key: str, choices) -> str:
    """The fix for an unknown key: rename it to the name it most likely misspells, else remove it."""
    close = closest(key, choices)
    return f"rename it to {close!r}" if close else "remove it (or fix its spelling)"


def section_problems(section: str, values: dict) -> list[tuple[str, str, str]]:
    """``(dotted key, message, fix)`` for each problem DeepSpeed's model for ``section`` finds in ``values``."""
    model = section_models()[section]
    try:
        with _deepspeed_quiet():
            model(**copy.deepcopy(values))
    except ValidationError as err:
        return [_describe(section, model, e) for e in err.errors()]
    except (AssertionError, ValueError, TypeError) as err:  # DeepSpeed's own checks inside the model
        return [(section, str(err).strip().splitlines()[0], f"fix the {section} section as the message says")]
    return []


def _model_at(model: type, loc: tuple) -> type:
    """The pydantic model that owns the last element of ``loc``."""
    for part in loc[:-1]:
        info = next((i for n, i in model.model_fields.items() if part in (n, i.alias)), None)
        nested = _field_model(info.annotation) if info is not None else None
        if nested is None:
            break
        model = nested
    return model


def field_default(model: type, loc: tuple):
    """The default DeepSpeed uses for the field at ``loc`` of ``model`` (``None`` when it has none)."""
    owner = _model_at(model, loc)
    info = next((i for n, i in owner.model_fields.items() if loc and loc[-1] in (n, i.alias)), None)
    if info is None or info.is_required():
        return None
    default = info.get_default(call_default_factory=True)
    return getattr(default, "value", default)  # enums: their value


def _one_of(expected: str) -> str:
    """pydantic's "0, 1, 2, 3 or 3" (an enum with an alias member) without repeats."""
    items = [item.strip() for item in re.split(r",| or ", expected) if item.strip()]
    items = list(dict.fromkeys(items))
    return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


def _describe(section: str, model: type, error: dict) -> tuple[str, str, str]:
    loc = tuple(str(p) for p in error.get("loc", ()) if not str(p).startswith("function-"))
    key = ".".join((section, *loc)) if loc else section
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        names = field_names(_model_at(model, loc))
        return key, f"unknown key {loc[-1]!r}{did_you_mean(loc[-1], names)}", unknown_key_fix(loc[-1], names)
    got = f" (got {short(error.get('input'))})"
    if kind in ("enum", "literal_error"):
        choices = _one_of(str(error.get("ctx", {}).get("expected", "")))
        return key, f"must be {choices}{got}", f"use {choices}"
    message = error.get("msg", "invalid value").removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind.startswith("int_"):
        fix = "write an integer"
    elif kind.startswith("bool_"):
        fix = "write true or false"
    elif kind.startswith(("float_", "greater_than", "less_than")):
        fix = "write a number in range"
    elif kind == "model_type" or kind == "dict_type":
        fix = "write a section (a JSON object) there"
    else:
        fix = ""
    default = field_default(model, loc) if loc else None
    if default is not None:
        fix = (fix + " or " if fix else "") + f"remove it to use DeepSpeed's default ({short(default)})"
    return key, message + got, fix or "remove it to use DeepSpeed's default"


def _deepspeed_error(config: dict) -> str | None:
    """The first line of what ``DeepSpeedConfig`` raises on ``config`` (world size 1), ``None`` if it accepts it."""
    from deepspeed.runtime.config import DeepSpeedConfig  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    try:
        with _deepspeed_quiet():
            DeepSpeedConfig(copy.deepcopy(config))
    except Exception as err:  # noqa: BLE001 - any failure is reported as one line
        text = str(err).strip()
        return text.splitlines()[0] if text else type(err).__name__
    return None


#: The smallest config DeepSpeedConfig accepts: the base each key is checked against on its own.
_BASE = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}


def key_problems(config: dict, keys) -> list[tuple[str, str, str]]:
    """``(key, message, fix)`` for each top-level key in ``keys`` that DeepSpeed's own parser rejects on its own
    (checked one by one, so that every such key is reported at once, by name)."""
    problems = []
    for key in keys:
        message = _deepspeed_error({**_BASE, key: config[key]})
        if message is not None:
            problems.append((key, f"DeepSpeed rejects it: {message}", "fix or remove it"))
    return problems


def validate_with_deepspeed(config: dict) -> list[tuple[str, str, str]]:
    """Run ``deepspeed.runtime.config.DeepSpeedConfig`` on the whole ``config`` (world size 1: the batch-size
    arithmetic is checked separately, for the real world size). On failure the key is found by leaving top-level
    keys out one at a time. Returns ``(key, message, fix)`` problems instead of raising."""
    probe = {k: v for k, v in config.items() if k != "train_batch_size"}  # DeepSpeed derives it (world size 1)
    message = _deepspeed_error(probe)
    if message is None:
        return []
    culprit = next((k for k in probe if _deepspeed_error({k2: v for k2, v in probe.items() if k2 != k}) is None), "")
    return [
        (
            culprit,
            f"DeepSpeed rejects the config: {message}",
            f"fix {culprit}" if culprit else "fix the config as the message says",
        )
    ]


# --- optimizer and scheduler parameters: the constructors DeepSpeed's engine calls ---------------------------------

#: Keys the engine pops from optimizer.params before calling the constructor (engine._configure_basic_optimizer,
#: get_optimizer_configuration), for the Adam family.
_ADAM_POPPED = {"adam_w_mode", "torch_adam", "fp32_optimizer_states"}


def _parameters(cls, skip: set[str]) -> set[str] | None:
    """Keyword parameters of ``cls``'s constructor, without ``skip``; ``None`` when it takes ``**kwargs``."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params) - {"self"} - skip


def optimizer_parameters(name: str, config: dict) -> tuple[str, set[str] | None]:
    """The optimizer class DeepSpeed's engine builds for ``optimizer.type`` ``name`` under ``config`` and the
    ``optimizer.params`` keys it accepts (``None``: any, or the class cannot be inspected here).

    The choice follows ``DeepSpeedEngine._configure_basic_optimizer``: Adam/AdamW become torch's with
    ``torch_adam``, ``DeepSpeedCPUAdam`` when the optimizer is offloaded, else ``FusedAdam``; Adagrad and Lion have a
    CPU variant for offload; other names are looked up in ``torch.optim``.
    """
    import torch  # noqa: PLC0415 (reading a config needs no torch: only checking an optimizer does)

    optimizer = config.get("optimizer")
    params = optimizer.get("params") if isinstance(optimizer, dict) else None
    params = params if isinstance(params, dict) else {}
    zero = config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    cpu = isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")
    lower = name.lower()
    try:
        if lower in ("adam", "adamw"):
            if params.get("torch_adam") is True:
                cls, own = (torch.optim.AdamW if lower == "adamw" else torch.optim.Adam), {"params"}
            elif cpu:
                from deepspeed.ops.adam import DeepSpeedCPUAdam as cls  # noqa: PLC0415 (slow, probes the accelerator: only where an optimizer is checked)

                own = {"model_params", "adamw_mode"}  # adamw_mode: the engine passes it itself
            else:
                from deepspeed.ops.adam import FusedAdam as cls  # noqa: PLC0415 (slow, probes the accelerator: only where an optimizer is checked)

                own = {"params"}
            accepted = _parameters(cls, own)
            return cls.__name__, None if accepted is None else accepted | _ADAM_POPPED
        if lower == "adagrad":
            from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad  # noqa: PLC0415 (slow, probes the accelerator: only where an optimizer is checked)

            cls = DeepSpeedCPUAdagrad if cpu else torch.optim.Adagrad
        elif lower == "lamb":
            from deepspeed.ops.lamb import FusedLamb as cls  # noqa: PLC0415 (slow, probes the accelerator: only where an optimizer is checked)
        elif lower == "lion":
            from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion  # noqa: PLC0415 (slow, probes the accelerator: only where an optimizer is checked)

            cls = DeepSpeedCPULion if cpu else FusedLion
        elif hasattr(torch.optim, name) and lower not in ("muadam", "muadamw", "musgd", "muon"):
            cls = getattr(torch.optim, name)
        else:  # mup's optimizers (an optional package) and Muon (its own parameter groups): not checked
            return name, None
    except ImportError:
        return name, None
    return cls.__name__, _parameters(cls, {"params", "model_params"})


def scheduler_parameters(name: str) -> set[str] | None:
    """The ``scheduler.params`` keys the LR scheduler DeepSpeed builds for ``name`` accepts (``None``: unknown)."""
    import torch  # noqa: PLC0415 (reading a config needs no torch: only checking a scheduler does)
    from deepspeed.runtime import lr_schedules  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(cls, type):
        return None
    return _parameters(cls, {"optimizer"})


# --- features DeepSpeed removed ---------------------------------------------------------------------------------


@functools.cache
def suggestable_top_level_keys() -> frozenset[str]:
    """Known top-level keys minus those of removed features: what a "did you mean" may propose."""
    from deepspeed.runtime import config as ds_config  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    from .versions import REMOVED  # noqa: PLC0415 (versions imports this module's neighbours; kept one-way)

    removed = set(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS) | {key for key in REMOVED if "." not in key}
    return known_top_level_keys() - frozenset(removed)
