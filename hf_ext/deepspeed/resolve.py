"""DeepSpeed configs: presets, loading, and resolution of every ``"auto"`` against TrainingArguments and the model
(the steps in order; the fill rules are :mod:`.fill`'s tables, the checks :mod:`.checks`).

:func:`resolve_deepspeed_config` does what transformers' ``HfTrainerDeepSpeedConfig`` does when it fills ``"auto"``
(batch sizes, accumulation, clipping, optimizer and scheduler values, precision, the hidden-size based bucket sizes)
and also what it leaves to crash late or to go silently wrong:

* the normalizations of :mod:`hf_ext.deepspeed.normalize` (deprecated spellings, string booleans, float literals, ...);
* precision: ``"auto"`` (or no fp16/bf16 section) with TrainingArguments saying nothing picks from the hardware
  (bf16, else fp16, on an accelerator; fp32 on CPU); a precision the config enables explicitly is adopted by
  TrainingArguments when they say nothing; fp16/bf16 the hardware lacks is an error;
* batch-size keys and ``gradient_clipping`` missing from the config are added from TrainingArguments (DeepSpeed would
  otherwise use accumulation 1 and no clipping while the Trainer assumes the arguments' values);
* a top-level ``"gradient_checkpointing": true`` (ignored by DeepSpeed) turns on activation checkpointing;
* ZeRO-3-only keys at stage < 3 are warned about (``"auto"`` ones dropped);
* explicit values that disagree with TrainingArguments are all collected and raised at once, each with its fix;
* an ``"auto"`` nothing can fill is an error naming the key: after resolution no ``"auto"`` is left;
* the result is checked with DeepSpeed's own config models: unknown keys at any level (with "did you mean"),
  wrong types, and DeepSpeed's own consistency checks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..batching import layout_of
from ..errors import Change, DeepSpeedConfigError, Problem, Report, short
from ..memory import auto
from ..memory.formulas import CPU_ZERO3_GRANULARITY, CPU_ZERO3_KEYS, Plan
from ..model_info import hidden_size_buckets, hidden_size_of
from ..runtime import Hardware, local_world_size
from ..sizes import gb
from . import schema
from .checks import stage3_only, validate, validate_named_sections
from .fill import HIDDEN_SIZE_KEYS, STEP_KEYS, fill_from_args, fill_steps, get_value, node_of, walk
from .load import describe, load, preset_name
from .normalize import GATHER_KEY, normalize

logger = logging.getLogger("hf_ext.deepspeed")

RESOLVED_CONFIG_NAME = "deepspeed_config.resolved.json"


def load_deepspeed_config(config: str | Path | dict) -> dict:
    """A DeepSpeed config as a fresh dict, from a dict, a JSON/YAML path or a preset name (nothing resolved)."""
    return load(config, Report())


@dataclass
class Resolution:
    """The resolved config and the record of how it was obtained."""

    config: dict
    origin: str
    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    args_updates: dict = field(default_factory=dict)  # TrainingArguments values the config implies
    memory_plan: Plan | None = None  # the memory planner's plan, when it planned the run
    given: object = None  # what was resolved, as given (a preset name, a path, a dict)
    version_rules: list[str] = field(default_factory=list)  # the version-dependent rules that applied

    def table(self) -> str:
        """Every filled/normalized key, its value and where the value came from, as an aligned text table."""
        rows = [("key", "value", "action", "source")]
        rows += [(c.key, short(c.value), c.action, c.source) for c in self.changes]
        widths = [min(60, max(len(r[i]) for r in rows)) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3] for row in rows
        ).rstrip()


def resolve_deepspeed_config(config, training_args, model=None, world_size: int | None = None, **kwargs) -> dict:
    """Resolve a DeepSpeed config against ``training_args`` (and ``model`` for the hidden-size based keys).

    Args:
        config: a path to a JSON file or an accelerate YAML, a dict, or a preset name (``zero1``, ``zero2``,
            ``zero3``, ``zero3_offload``).
        training_args: the :class:`transformers.TrainingArguments` of the run.
        model: a model, its config, or a path/hub id of one; needed when bucket sizes are ``"auto"``.
        world_size: number of ranks; defaults to ``training_args.world_size``.
        **kwargs: ``num_training_steps`` (defaults to ``training_args.max_steps`` when > 0) and ``hardware``
            (a :class:`Hardware`, detected when omitted); see :func:`explain_deepspeed_config`.

    Returns:
        The resolved config: no ``"auto"`` left, validated by DeepSpeed's own config models. Use
        :func:`explain_deepspeed_config` for the record of every filled or normalized key and its source.

    Raises:
        DeepSpeedConfigError: with every problem found (mismatches with ``training_args``, unknown keys, invalid
            values, unfillable ``"auto"``), one line each with its fix.
    """
    return explain_deepspeed_config(config, training_args, model, world_size, **kwargs).config


def explain_deepspeed_config(
    config,
    training_args,
    model=None,
    world_size: int | None = None,
    *,
    num_training_steps: int | None = None,
    hardware: Hardware | None = None,
    defer: bool = False,
    raise_errors: bool = True,
) -> Resolution:
    """Like :func:`resolve_deepspeed_config`, but returns the whole :class:`Resolution` record.

    ``defer=True`` leaves the ``"auto"`` values that need the model or the number of training steps in place when
    those are unknown (they are filled at train start); ``raise_errors=False`` returns problems in
    ``Resolution.problems`` instead of raising.
    """
    report = Report()
    origin = describe(config)
    try:
        raw = load(config, report)
    except DeepSpeedConfigError as err:
        if raise_errors:
            err.origin = err.origin or origin
            raise
        return Resolution({}, origin, report.changes, report.warnings, err.problems)
    foreign = _not_deepspeed(raw, origin)
    if foreign is not None:  # one line, not one per key of somebody else's config
        if raise_errors:
            raise DeepSpeedConfigError([foreign], origin)
        return Resolution({}, origin, report.changes, report.warnings, [foreign])
    resolved, normal = normalize(raw)
    report.extend(normal)
    resolution = Resolution(resolved, origin)
    args = _Updated(training_args, resolution.args_updates)  # training_args themselves are never written
    world = world_size if world_size is not None else args.world_size
    # the ranks a batch is split over: all of them unless tensor/sequence/context parallelism groups them
    layout = layout_of(world, resolved, getattr(args, "parallelism_config", None), model)
    if problem := layout.problem():  # a warning: a config is often resolved where it will not run (1 rank, by default)
        report.warn(f"{problem}: launch it on a multiple of {layout.model_parallel} ranks")
    _gradient_checkpointing(resolved, report, resolution)
    hardware = hardware or Hardware.detect(getattr(args, "use_cpu", False))
    precision = _precision(resolved, args, hardware, report, resolution)
    cpu_preset = hardware.device == "cpu" and preset_name(config) is not None
    if cpu_preset and _stage(resolved) == 3:  # before planning: the plan is of the sizes the run will use
        _cpu_zero3_preset(resolved, report)
    _memory_autos(resolved, args, model, layout.dp, hardware, precision, report, resolution)
    validate_named_sections(resolved, report)  # before filling: a misspelt or foreign param is reported as such
    fill_from_args(resolved, args, layout, report)
    stage = _stage(resolved)
    stage3_only(resolved, stage, report)
    if stage == 3:
        _gather_default(resolved, report)
        if cpu_preset:  # again when the planner chose stage 3 (a no-op when applied above)
            _cpu_zero3_preset(resolved, report)
    if model is not None:
        try:
            report.changes += fill_model_keys(resolved, model)
        except DeepSpeedConfigError as err:
            report.problems += err.problems
    steps = num_training_steps
    if steps is None and not defer and args.max_steps > 0:
        steps = args.max_steps
    if steps is not None:
        fill_steps(resolved, args, steps, report)
    _leftover_autos(resolved, report, defer)
    resolution.version_rules = validate(resolved, report)
    resolution.changes, resolution.warnings, resolution.problems = report.changes, report.warnings, report.problems
    for message in report.warnings:
        logger.warning(message)
    if report.problems and raise_errors:
        raise DeepSpeedConfigError(report.problems, origin)
    return resolution


class _Updated:
    """``args`` as the resolution sees them: its ``args_updates`` (a micro-batch the planner chose, a precision the
    config implies) over the arguments' own values. The caller applies the updates; the resolver only reads."""

    def __init__(self, args, updates: dict):
        self._args, self._updates = args, updates

    def __getattr__(self, name):
        return self._updates[name] if name in self._updates else getattr(self._args, name)


def _not_deepspeed(config: dict, origin: str) -> Problem | None:
    """A file that is some other tool's config (GPT-NeoX, Megatron, a training YAML) rather than a DeepSpeed one:
    most of its top-level keys mean nothing to DeepSpeed."""
    unknown = [k for k in config if k not in schema.known_top_level_keys()]
    if len(unknown) < 5 or len(unknown) <= len(config) - len(unknown):
        return None
    return Problem(
        "",
        f"{origin} is not a DeepSpeed config: {len(unknown)} of its {len(config)} top-level keys mean nothing to "
        f"DeepSpeed ({', '.join(map(str, unknown[:4]))}, ...)",
        "pass the DeepSpeed JSON (or accelerate YAML) the training run uses",
    )


def _stage(config: dict) -> int:
    stage = get_value(config, "zero_optimization.stage", 0)
    return stage if isinstance(stage, int) else 0


# --- resolution steps -------------------------------------------------------------------------------------------


def _gradient_checkpointing(config: dict, report: Report, resolution: Resolution):
    if "gradient_checkpointing" not in config:
        return
    value = config.pop("gradient_checkpointing")
    if value is True:
        resolution.args_updates["activation_checkpointing"] = True
        report.change("gradient_checkpointing", True, "TrainingArguments.activation_checkpointing=True", "moved")
        report.warn(
            'DeepSpeed ignores a top-level "gradient_checkpointing": true; activation checkpointing is turned on '
            "in the model instead (TrainingArguments.activation_checkpointing=True). Set that argument and drop the "
            "key to silence this."
        )
    else:
        report.change("gradient_checkpointing", value, "top-level key DeepSpeed ignores", "removed")


def _memory_autos(
    config: dict,
    args,
    model,
    world: int,
    hardware: Hardware,
    precision: str | None,
    report: Report,
    resolution: Resolution,
):
    """ZeRO stage / offload devices / micro-batch ``"auto"``: chosen by the memory planner (hf_ext.memory.auto).
    ``world``: the data-parallel ranks, over which ZeRO shards (a tensor-parallel split of each parameter on top is
    not counted: the plan is an upper bound there)."""
    micro = args.per_device_train_batch_size
    keys = auto.auto_keys(config, micro)
    plan_model = getattr(args, "plan_model", None)
    if not keys and plan_model is None:
        return  # nothing to choose and no plan asked for: no probe
    model = model if model is not None else plan_model
    if model is None:
        for key in keys:
            report.problem(key, '"auto" needs the model to plan memory', "pass plan_model=PATH (--plan_model PATH)")
        return
    checkpointing = bool(
        getattr(args, "activation_checkpointing", False)
        or getattr(args, "gradient_checkpointing", False)
        or resolution.args_updates.get("activation_checkpointing")
    )
    decision = auto.decide(
        config,
        keys,
        model,
        world_size=world,
        local_ranks=local_world_size(),
        precision=precision or "fp32",
        device=hardware.device,
        micro_batch=None if micro == "auto" else int(micro),
        accumulation_steps=args.gradient_accumulation_steps,
        seq_len=int(getattr(args, "plan_seq_len", 128) or 128),
        checkpointing=checkpointing,
        memory_per_device=getattr(args, "memory_per_device", None),
    )
    chosen, source = decision.plan, decision.budget_source
    if chosen is None and decision.smallest is None:  # what the config fixes rules every ZeRO setup out
        fixed = {
            k: v
            for k, v in (config.get("zero_optimization") or {}).items()
            if k in ("stage", "offload_optimizer", "offload_param")
            and not any(key.startswith(f"zero_optimization.{k}") for key in keys)
        }
        report.problem(
            keys[0],
            f'"auto" has nothing to choose from: no ZeRO setup has {short(fixed)}',
            'set those keys to "auto" too, or to a combination DeepSpeed runs (offload_param needs stage 3)',
        )
        return
    if chosen is None:
        smallest = decision.smallest
        report.problem(
            keys[0],
            f"nothing fits the {gb(smallest.budget)} per rank ({source}): the smallest plan, "
            f"{smallest.candidate.name} at micro-batch {smallest.micro_batch}, needs "
            f"{gb(smallest.total_bytes + smallest.baseline)}",
            "lower per_device_train_batch_size or plan_seq_len, turn on activation checkpointing, add ranks, "
            "or raise memory_per_device",
        )
        _apply_memory_plan(config, smallest, keys, report, source)  # so that the only error is the one above
        if micro == "auto":
            resolution.args_updates["per_device_train_batch_size"] = 1
        return
    _apply_memory_plan(config, chosen, keys, report, source)
    if micro == "auto":
        resolution.args_updates["per_device_train_batch_size"] = chosen.micro_batch
        report.change(
            "TrainingArguments.per_device_train_batch_size",
            chosen.micro_batch,
            f"planner: largest micro-batch that fits ({source})",
        )
    resolution.memory_plan = chosen


def _apply_memory_plan(config: dict, plan, keys: list[str], report: Report, source: str) -> None:
    zero = config.setdefault("zero_optimization", {})
    c = plan.candidate
    why = auto.describe_choice(plan, source)
    if auto.STAGE_KEY in keys:
        zero["stage"] = c.stage
        report.change(auto.STAGE_KEY, c.stage, why)
        if c.stage < 3:  # the stage-3 settings of the auto preset do not apply
            for key in [k for k in zero if k in schema.STAGE3_ONLY_KEYS and k != "offload_param"]:
                report.change(f"zero_optimization.{key}", zero.pop(key), f"planner chose stage {c.stage}", "removed")
    for section, on in (("offload_optimizer", c.offload_optimizer), ("offload_param", c.offload_param)):
        key = f"zero_optimization.{section}.device"
        if key not in keys:
            continue
        if on:
            zero[section]["device"] = "cpu"
            report.change(key, "cpu", why)
        else:
            zero.pop(section)
            report.change(f"zero_optimization.{section}", "auto", why + ": no offload", "removed")
    logger.info(
        f"Memory plan: {c.name} at micro-batch {plan.micro_batch}, {gb(plan.total_bytes)} per rank "
        f"above the process baseline (budget {gb(plan.budget)}, {source})"
    )


def _precision(config: dict, args, hardware: Hardware, report: Report, resolution: Resolution) -> str | None:
    """The one precision rule: what TrainingArguments ask for, else what the config enables explicitly, else the
    hardware's default. Fills the fp16/bf16 sections and returns ``"bf16"``, ``"fp16"`` or ``None`` (fp32)."""
    asked = "bf16" if (args.bf16 or args.bf16_full_eval) else "fp16" if (args.fp16 or args.fp16_full_eval) else None
    current = {name: (config.get(name) or {}).get("enabled", "auto") for name in ("fp16", "bf16")}
    if asked:
        source, flag = f"TrainingArguments.{asked}", f"--{asked}"
        chosen = asked
        for name in ("fp16", "bf16"):
            if current[name] not in ("auto", name == asked):
                report.problem(
                    f"{name}.enabled",
                    f"is {short(current[name])} but TrainingArguments asks for {asked} ({flag})",
                    f'set {name}.enabled to "auto", or drop {flag}',
                )
    else:
        explicit = [name for name in ("fp16", "bf16") if current[name] is True]
        if len(explicit) == 2:
            report.problem("fp16.enabled", "fp16 and bf16 are both enabled", "enable at most one of them")
            return None
        if explicit:
            chosen, source = explicit[0], f"{explicit[0]}.enabled in the config"
            resolution.args_updates[chosen] = True
        else:
            chosen = hardware.default_precision()
            source = f"hardware: {hardware.device}" + ("" if chosen else " (full fp32)")
            if chosen:
                resolution.args_updates[chosen] = True
    if chosen and not getattr(hardware, chosen):
        report.problem(
            f"{chosen}.enabled",
            f"{chosen} is asked for by {source} but this {hardware.device} host has no {chosen} support",
            f'set {chosen}.enabled to "auto" (or false), or train where {chosen} is supported',
        )
    for name in ("fp16", "bf16"):
        wanted = name == chosen
        if current[name] == "auto" or name not in config:
            config.setdefault(name, {})["enabled"] = wanted
            report.change(f"{name}.enabled", wanted, source)
    if "bf16" in resolution.args_updates or "fp16" in resolution.args_updates:
        report.change(f"TrainingArguments.{chosen}", True, source, "filled")
    return chosen


def _gather_default(config: dict, report: Report):
    zero = config["zero_optimization"]
    if zero.get(GATHER_KEY) == "auto":
        zero[GATHER_KEY] = True
        report.change(f"zero_optimization.{GATHER_KEY}", True, "hf-ext default, so that save_model() writes weights")
    elif zero.get(GATHER_KEY) is not True:
        report.warn(
            f"zero_optimization.{GATHER_KEY} is not true: under ZeRO-3, save_model() will not write usable weights "
            "(only the DeepSpeed checkpoint). Set it to true to save a loadable model."
        )


def _cpu_zero3_preset(config: dict, report: Report):
    zero = config["zero_optimization"]
    for key in CPU_ZERO3_KEYS:
        if zero.get(key) != CPU_ZERO3_GRANULARITY:
            zero[key] = CPU_ZERO3_GRANULARITY
            report.change(f"zero_optimization.{key}", CPU_ZERO3_GRANULARITY, "preset on a CPU-only host: bounded RAM")


def fill_model_keys(config: dict, model) -> list[Change]:
    """Fill the hidden-size based ``"auto"`` keys of ``config`` in place (integers, as DeepSpeed requires)."""
    auto_keys = [k for k in HIDDEN_SIZE_KEYS if get_value(config, k) == "auto"]
    if not auto_keys:
        return []
    hidden = hidden_size_of(model)
    if hidden is None:
        raise DeepSpeedConfigError(
            [
                Problem(k, '"auto" needs the model\'s hidden size, which its config does not have', "set an integer")
                for k in auto_keys
            ]
        )
    rules = {f"zero_optimization.{key}": rule for key, rule in hidden_size_buckets(hidden).items()}
    changes = []
    for key in auto_keys:
        node, leaf = node_of(config, key)
        value, formula = rules[key]
        node[leaf] = value
        changes.append(Change(key, value, f"model: {formula}"))
    return changes


def _leftover_autos(config: dict, report: Report, defer: bool):
    for key, value in walk(config):
        if value != "auto" or key.split(".")[0] not in schema.known_top_level_keys():
            continue  # unknown keys are reported once, as unknown
        if key in HIDDEN_SIZE_KEYS:
            if defer:
                report.change(key, "auto", "model: filled when the Trainer gets the model", "deferred")
            else:
                report.problem(key, '"auto" needs the model\'s hidden size', "pass the model (--model PATH)")
        elif key in STEP_KEYS:
            if defer:
                report.change(key, "auto", "number of training steps: filled at train start", "deferred")
            else:
                report.problem(key, '"auto" needs the number of training steps', "pass --max_steps N")
        elif not any(problem.key == key for problem in report.problems):  # said once, by whoever knew why
            report.problem(key, '"auto" here has no source to fill it from', "replace it with a value")
