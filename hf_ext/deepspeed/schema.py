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
import io
import logging
import typing

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


def _deepspeed_logging_quiet():
    """DeepSpeed logs a line per config parse; keep ``hf-ext`` output to what the user asked for."""
    from deepspeed.utils import logger as ds_logger

    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)
    return level


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
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    probe = _RecordingDict(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    level = _deepspeed_logging_quiet()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig(probe)
    finally:
        ds_logger.setLevel(level)
    return frozenset(k for k in probe.seen if isinstance(k, str)) | frozenset(_SECTIONS_READ_ELSEWHERE)


@functools.cache
def section_models() -> dict[str, type]:
    """DeepSpeed's pydantic model for each section it validates strictly (unknown keys there are errors)."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

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
    from pydantic import BaseModel

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
    """Dotted paths (aliases included) of the ``int`` (``kind="int"``) or ``bool`` fields of the strict sections."""
    wanted = {"int": int, "bool": bool}[kind]
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


def did_you_mean(key: str, choices) -> str:
    close = difflib.get_close_matches(str(key).lower(), sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def section_problems(section: str, values: dict) -> list[tuple[str, str]]:
    """``(dotted key, message)`` for each problem DeepSpeed's model for ``section`` finds in ``values``."""
    from pydantic import ValidationError

    model = section_models()[section]
    level = _deepspeed_logging_quiet()
    from deepspeed.utils import logger as ds_logger

    try:
        model(**copy.deepcopy(values))
    except ValidationError as err:
        return [_describe(section, model, e) for e in err.errors()]
    except (AssertionError, ValueError, TypeError) as err:  # DeepSpeed's own checks inside the model
        return [(section, str(err).strip().splitlines()[0])]
    finally:
        ds_logger.setLevel(level)
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


def _describe(section: str, model: type, error: dict) -> tuple[str, str]:
    loc = tuple(str(p) for p in error.get("loc", ()) if not str(p).startswith("function-"))
    key = ".".join((section, *loc)) if loc else section
    if error.get("type") == "extra_forbidden":
        owner = _model_at(model, loc)
        return key, f"unknown key {loc[-1]!r}{did_you_mean(loc[-1], field_names(owner))}"
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    return key, f"{message} (got {error.get('input')!r})"


def validate_with_deepspeed(config: dict) -> list[tuple[str, str]]:
    """Run ``deepspeed.runtime.config.DeepSpeedConfig`` on ``config`` (world size 1: the batch-size arithmetic is
    checked separately, for the real world size). Returns ``(key, message)`` problems instead of raising."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger as ds_logger

    probe = copy.deepcopy(config)
    probe.pop("train_batch_size", None)  # DeepSpeed derives it from micro batch x accumulation x world size
    level = _deepspeed_logging_quiet()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            DeepSpeedConfig(probe)
    except Exception as err:  # noqa: BLE001 - any failure is reported as one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return [("", f"DeepSpeed rejects the config: {first}")]
    finally:
        ds_logger.setLevel(level)
    return []
