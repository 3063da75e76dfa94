"""DeepSpeed configs: presets, loading, and resolution of every ``"auto"`` against TrainingArguments and the model.

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

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..batching import split_batch
from ..errors import Change, DeepSpeedConfigError, Problem, Report, short
from ..memory import auto
from ..memory.formulas import CPU_ZERO3_GRANULARITY, CPU_ZERO3_KEYS, Plan
from ..model_info import hidden_size_buckets, hidden_size_of
from ..runtime import Hardware, local_world_size
from ..sizes import gb
from . import schema
from .load import describe, load, preset_name
from .normalize import GATHER_KEY, normalize

logger = logging.getLogger("hf_ext.deepspeed")

RESOLVED_CONFIG_NAME = "deepspeed_config.resolved.json"
HIDDEN_SIZE_KEYS = tuple(f"zero_optimization.{key}" for key in hidden_size_buckets(1))
STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


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
    _gradient_checkpointing(resolved, report, resolution)
    hardware = hardware or Hardware.detect(getattr(args, "use_cpu", False))
    precision = _precision(resolved, args, hardware, report, resolution)
    cpu_preset = hardware.device == "cpu" and preset_name(config) is not None
    if cpu_preset and _stage(resolved) == 3:  # before planning: the plan is of the sizes the run will use
        _cpu_zero3_preset(resolved, report)
    _memory_autos(resolved, args, model, world, hardware, precision, report, resolution)
    _validate_named_sections(resolved, report)  # before filling: a misspelt or foreign param is reported as such
    _fill_from_args(resolved, args, world, report)
    stage = _stage(resolved)
    _stage3_only(resolved, stage, report)
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
        _fill_steps(resolved, args, steps, report)
    _leftover_autos(resolved, report, defer)
    _validate(resolved, report)
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


# --- helpers on dotted keys -------------------------------------------------------------------------------------


def node_of(config: dict, key: str, create: bool = False) -> tuple[dict | None, str]:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        if not isinstance(node.get(part), dict):
            if not create:
                return None, leaf
            node[part] = {}
        node = node[part]
    return node, leaf


def get_value(config: dict, key: str, default=None):
    node, leaf = node_of(config, key)
    return default if node is None else node.get(leaf, default)


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _non_negative(value) -> bool:
    """A finite number >= 0 (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _betas(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(_non_negative(b) and b < 1 for b in value)


#: What a value hf-ext fills or compares must be, so that an invalid one is reported as invalid (with a fix that
#: works) instead of as a mismatch whose fix would pass the invalid value on as a flag.
VALID_VALUES = {
    "train_micro_batch_size_per_gpu": (_positive_int, "a positive integer"),
    "gradient_accumulation_steps": (_positive_int, "a positive integer"),
    "train_batch_size": (_positive_int, "a positive integer"),
    "gradient_clipping": (_non_negative, "a number >= 0 (0: no clipping)"),
    "optimizer.params.lr": (_non_negative, "a number >= 0"),
    "optimizer.params.betas": (_betas, "two numbers in [0, 1)"),
    "optimizer.params.eps": (_non_negative, "a number >= 0"),
    "optimizer.params.weight_decay": (_non_negative, "a number >= 0"),
    "scheduler.params.warmup_min_lr": (_non_negative, "a number >= 0"),
    "scheduler.params.warmup_max_lr": (_non_negative, "a number >= 0"),
    "scheduler.params.total_num_steps": (_positive_int, "a positive integer"),
    "scheduler.params.warmup_num_steps": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
        "an integer >= 0",
    ),  # fmt: skip
}


def _is_valid(config: dict, key: str) -> bool:
    value = get_value(config, key, "auto")
    rule = VALID_VALUES.get(key)
    return value == "auto" or rule is None or rule[0](value)


def _valid(config: dict, key: str, report: Report, source: str = "") -> bool:
    """Whether the value at ``key`` is "auto", missing or valid; an invalid one is reported with a fix."""
    if _is_valid(config, key):
        return True
    value, rule = get_value(config, key), VALID_VALUES[key]
    fill = f'"auto" ({source}) or ' if source else ""
    report.problem(key, f"{short(value)} is not {rule[1]}", f"set it to {fill}{rule[1]}")
    return False


@dataclass(frozen=True)
class FillRule:
    """How one config key is filled from the arguments: its value, where the value comes from (said in the record
    and in a mismatch), the ``TrainingArguments`` fields a mismatch's fix sets (to the config's value), whether a
    missing key is added, and whether an explicit value must match (else it is left as the user wrote it)."""

    key: str
    value: Callable  # (args, world size) -> the value
    source: str | Callable  # text, or (args, world size) -> text
    fields: tuple[str, ...] = ()  # the argument(s) behind the value, in the order of a list value
    add: bool = False
    match: bool = True
    needs: str | None = None  # a section (dotted key) that must be a dict for the rule to apply
    called: str | None = None  # what a mismatch calls the value (default: its fields)

    def source_of(self, args, world: int) -> str:
        return self.source(args, world) if callable(self.source) else self.source

    def args_fix(self, current) -> dict:
        """The flags that make the arguments say what the config says (none when no argument sets the value)."""
        if len(self.fields) == 1:
            return {self.fields[0]: current}
        if self.fields and isinstance(current, list) and len(current) == len(self.fields):
            return dict(zip(self.fields, current))
        return {}


def _fill(config: dict, report: Report, rule: FillRule, value, source: str, match: bool = True) -> None:
    """Replace ``"auto"`` at ``rule.key`` by ``value``; add it when missing and ``rule.add``; else compare when the
    rule (and ``match``) asks for it."""
    key = rule.key
    if any(problem.key == key for problem in report.problems):
        return  # said once, by whoever knew why (a param the constructor lacks, say)
    node, leaf = node_of(config, key, create=rule.add)
    if node is None or not _valid(config, key, report, source):
        return
    if leaf not in node:
        if rule.add:
            node[leaf] = value
            report.change(key, value, f"{source} (missing in the config)", "added")
        return
    current = node[leaf]
    if current == "auto":
        node[leaf] = value
        report.change(key, value, source)
    elif rule.match and match and not _same(current, value):
        fix = f'set {key} to "auto"'
        args_fix = rule.args_fix(current)
        if args_fix:
            flags = " ".join(f"--{k} {short(v)}" for k, v in args_fix.items())
            fix += f", or pass {flags}"
        named = rule.called or (rule.fields[0] if len(rule.fields) == 1 else f"[{', '.join(rule.fields)}]")
        report.problem(key, f"is {short(current)} but {named} is {short(value)}", fix, args_fix or None)


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


def _memory_autos(config: dict, args, model, world: int, hardware: Hardware, precision: str | None, report: Report,
                  resolution: Resolution):  # fmt: skip
    """ZeRO stage / offload devices / micro-batch ``"auto"``: chosen by the memory planner (hf_ext.memory.auto)."""
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
        fixed = {k: v for k, v in (config.get("zero_optimization") or {}).items()
                 if k in ("stage", "offload_optimizer", "offload_param")
                 and not any(key.startswith(f"zero_optimization.{k}") for key in keys)}  # fmt: skip
        report.problem(keys[0], f'"auto" has nothing to choose from: no ZeRO setup has {short(fixed)}',
                       'set those keys to "auto" too, or to a combination DeepSpeed runs (offload_param needs stage 3)')  # fmt: skip
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
        report.change("TrainingArguments.per_device_train_batch_size", chosen.micro_batch,
                      f"planner: largest micro-batch that fits ({source})")  # fmt: skip
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
    logger.info(f"Memory plan: {c.name} at micro-batch {plan.micro_batch}, {gb(plan.total_bytes)} per rank "
                f"above the process baseline (budget {gb(plan.budget)}, {source})")  # fmt: skip


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_arithmetic(config: dict, args, world: int, report: Report) -> bool:
    """An explicit ``train_batch_size`` that world x micro-batch x accumulation cannot give, as one problem stating
    the arithmetic and the settings that satisfy it (one fix, not one mismatch after another). True if reported."""
    values = {key: config.get(key, "auto") for key in BATCH_KEYS}
    if not all(_is_valid(config, key) for key in BATCH_KEYS) or values["train_batch_size"] == "auto":
        return False
    total = values["train_batch_size"]
    micro = values["train_micro_batch_size_per_gpu"]
    accum = values["gradient_accumulation_steps"]
    micro = args.per_device_train_batch_size if micro == "auto" else micro
    accum = args.gradient_accumulation_steps if accum == "auto" else accum
    if not all(_positive_int(v) for v in (micro, accum)) or world * micro * accum == total:
        return False
    explicit = [key for key in BATCH_KEYS[1:] if values[key] != "auto"]
    arithmetic = f"{world} ranks x micro-batch {micro} x accumulation {accum} = {world * micro * accum}"
    if total % world:
        report.problem("train_batch_size", f"{total} cannot be split over {world} ranks ({arithmetic})",
                       f'set train_batch_size to "auto" or a multiple of {world}')  # fmt: skip
        return True
    new_micro, new_accum = split_batch(total, world, micro)
    flags = f"--per_device_train_batch_size {new_micro} --gradient_accumulation_steps {new_accum}"
    autos = f'set {" and ".join(explicit)} to "auto" and ' if explicit else ""
    report.problem(
        "train_batch_size",
        f"is {total} but {arithmetic}",
        f'{autos}pass {flags} ({world} x {new_micro} x {new_accum} = {total}), or set train_batch_size to "auto"',
        {} if explicit else {"per_device_train_batch_size": new_micro, "gradient_accumulation_steps": new_accum},
    )
    return True


def _from_args(name: str):
    return lambda args, world: getattr(args, name)


#: the keys filled from TrainingArguments, in order: value, source, the argument(s) a mismatch's fix sets
ARG_RULES = (
    FillRule("train_micro_batch_size_per_gpu", _from_args("per_device_train_batch_size"),
             "TrainingArguments.per_device_train_batch_size", ("per_device_train_batch_size",), add=True),
    FillRule("gradient_accumulation_steps", _from_args("gradient_accumulation_steps"),
             "TrainingArguments.gradient_accumulation_steps", ("gradient_accumulation_steps",), add=True),
    FillRule("train_batch_size",
             lambda args, world: world * args.per_device_train_batch_size * args.gradient_accumulation_steps,
             lambda args, world: f"world size {world} x per_device_train_batch_size {args.per_device_train_batch_size}"
                                 f" x gradient_accumulation_steps {args.gradient_accumulation_steps}", add=True,
             called="world_size x per_device_train_batch_size x gradient_accumulation_steps"),
    FillRule("gradient_clipping", _from_args("max_grad_norm"), "TrainingArguments.max_grad_norm",
             ("max_grad_norm",), add=True),
    FillRule("optimizer.params.lr", _from_args("learning_rate"), "TrainingArguments.learning_rate",
             ("learning_rate",), needs="optimizer.params"),
    FillRule("optimizer.params.betas", lambda args, world: [args.adam_beta1, args.adam_beta2],
             "TrainingArguments.adam_beta1/adam_beta2", ("adam_beta1", "adam_beta2"), needs="optimizer.params"),
    FillRule("optimizer.params.eps", _from_args("adam_epsilon"), "TrainingArguments.adam_epsilon",
             ("adam_epsilon",), needs="optimizer.params"),
    FillRule("optimizer.params.weight_decay", _from_args("weight_decay"), "TrainingArguments.weight_decay",
             ("weight_decay",), needs="optimizer.params"),
    FillRule("scheduler.params.warmup_min_lr", lambda args, world: 0, "0, as transformers does", match=False,
             needs="scheduler.params"),
    FillRule("scheduler.params.warmup_max_lr", _from_args("learning_rate"), "TrainingArguments.learning_rate",
             ("learning_rate",), needs="scheduler.params"),
)  # fmt: skip
#: the keys filled from the number of training steps (at train start, or from max_steps)
STEP_RULES = (
    FillRule("scheduler.params.total_num_steps", lambda args, steps: steps, "number of training steps",
             needs="scheduler.params", called="the number of training steps"),
    FillRule("scheduler.params.warmup_num_steps", lambda args, steps: max(1, args.get_warmup_steps(steps)),
             "TrainingArguments warmup (at least 1)", ("warmup_steps",), needs="scheduler.params",
             called="TrainingArguments warmup"),
)  # fmt: skip


def _apply_rules(config: dict, args, world: int, report: Report, rules, match: bool = True) -> None:
    for rule in rules:
        if rule.needs is None or isinstance(get_value(config, rule.needs), dict):
            _fill(config, report, rule, rule.value(args, world), rule.source_of(args, world), match)


def _fill_from_args(config: dict, args, world: int, report: Report):
    matched = not _batch_arithmetic(config, args, world, report)  # else said once, with the arithmetic
    _apply_rules(config, args, world, report, ARG_RULES[:3], match=matched)
    _apply_rules(config, args, world, report, ARG_RULES[3:])
    if "zero_optimization" not in config:
        config["zero_optimization"] = {"stage": 0}
        report.change("zero_optimization.stage", 0, "DeepSpeed's default (accelerate refuses a config without it)", "added")  # fmt: skip
    _schedule_choice(config, args, report)
    if getattr(args, "save_on_each_node", False):
        rule = FillRule(
            "checkpoint.use_node_local_storage", lambda args, world: True, "", ("save_on_each_node",), add=True
        )
        _fill(config, report, rule, True, "TrainingArguments.save_on_each_node")


#: The transformers schedule each DeepSpeed scheduler runs (after its warmup).
SCHEDULE_OF = {"WarmupLR": "constant_with_warmup", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def _schedule_choice(config: dict, args, report: Report):
    """A config ``scheduler`` section replaces the Trainer's schedule (transformers builds DeepSpeed's instead), so an
    ``lr_scheduler_type`` the user chose that differs from it would be silently ignored: say so."""
    kind = get_value(config, "scheduler.type")
    asked = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    default = next((f.default for f in dataclasses.fields(args) if f.name == "lr_scheduler_type"), None)
    default = str(getattr(default, "value", default))
    if not isinstance(kind, str) or asked == default or SCHEDULE_OF.get(kind) == asked:
        return
    same = next((name for name, schedule in SCHEDULE_OF.items() if schedule == asked), None)
    instead = f', or set scheduler.type to "{same}"' if same else ""
    report.warn(f"scheduler.type {kind} in the config is the schedule that runs: lr_scheduler_type {asked} is ignored "
                f"(transformers builds DeepSpeed's scheduler). Remove the scheduler section to use {asked}{instead}.")  # fmt: skip


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


def _stage3_only(config: dict, stage: int, report: Report):
    zero = config.get("zero_optimization")
    if stage >= 3 or not isinstance(zero, dict):
        return
    for key in [k for k in zero if k in schema.STAGE3_ONLY_KEYS]:
        if zero[key] == "auto":
            zero.pop(key)
            report.change(f"zero_optimization.{key}", "auto", f"ZeRO-3-only key at stage {stage}", "removed")
        elif key != GATHER_KEY or zero[key] is True:
            report.warn(f"zero_optimization.{key} only matters at ZeRO stage 3; it has no effect at stage {stage}")


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
            ]  # fmt: skip
        )
    rules = {f"zero_optimization.{key}": rule for key, rule in hidden_size_buckets(hidden).items()}
    changes = []
    for key in auto_keys:
        node, leaf = node_of(config, key)
        value, formula = rules[key]
        node[leaf] = value
        changes.append(Change(key, value, f"model: {formula}"))
    return changes


def _fill_steps(config: dict, args, steps: int, report: Report):
    _apply_rules(config, args, steps, report, STEP_RULES)


def walk(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node


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


def _validate_named_sections(config: dict, report: Report):
    """optimizer/scheduler: known type, known keys, and params the constructor DeepSpeed calls accepts. Run before
    the leftover-"auto" check, so that a misspelt parameter set to "auto" is reported as misspelt."""
    _validate_named(config, "optimizer", ("type", "params", "legacy_fusion"), _optimizer_names(), report)
    _validate_named(config, "scheduler", ("type", "params"), _scheduler_names(), report)


def _validate(config: dict, report: Report):
    known = schema.suggestable_top_level_keys()
    for key in config:
        if key not in schema.known_top_level_keys():
            report.problem(key, f"unknown top-level key{schema.did_you_mean(key, known)}; DeepSpeed would silently "
                           "ignore it", schema.unknown_key_fix(key, known))  # fmt: skip
    for key, message in schema.removed_keys(config):
        report.problem(key, f"removed from DeepSpeed: {message}", "remove it")
    for section in schema.section_models():
        if isinstance(config.get(section), dict):
            for key, message, fix in schema.section_problems(section, config[section]):
                if key in HIDDEN_SIZE_KEYS:
                    fix = 'set it to "auto" (from the model\'s hidden size) or a positive integer'
                report.problem(key, message, fix)
    _nvme_paths(config, report)
    reported = {p.key.split(".")[0] for p in report.problems}
    others = [k for k in config if k in schema.known_top_level_keys() and k not in reported and k not in OWN_CHECKS]
    for key, message, fix in schema.key_problems(config, others):
        report.problem(key, message, fix)
    if not report.problems:
        for key, message, fix in schema.validate_with_deepspeed(config):
            report.problem(key, message, fix)


#: Top-level keys checked above (by DeepSpeed's section models or hf-ext's own rules), not one by one again.
OWN_CHECKS = (*BATCH_KEYS, "zero_optimization", "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping")


def _nvme_paths(config: dict, report: Report):
    zero = config.get("zero_optimization")
    for section in ("offload_optimizer", "offload_param"):
        offload = zero.get(section) if isinstance(zero, dict) else None
        if isinstance(offload, dict) and offload.get("device") == "nvme" and not offload.get("nvme_path"):
            report.problem(
                f"zero_optimization.{section}.nvme_path",
                "is missing: the device is nvme but no directory is given (DeepSpeed fails at engine start)",
                f"set zero_optimization.{section}.nvme_path to a directory on a local NVMe disk, or set the device "
                'to "cpu"',
            )


def _optimizer_names() -> tuple[set[str], set[str]]:
    """(names DeepSpeed matches case-insensitively, torch.optim names it looks up as written)."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    return set(DEEPSPEED_OPTIMIZERS), {n for n in dir(torch.optim) if n[0].isupper() and n != "Optimizer"}


def _scheduler_names() -> tuple[set[str], set[str]]:
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    return set(), set(VALID_LR_SCHEDULES)


#: optimizer.params keys DeepSpeed refuses with its own message (engine._configure_basic_optimizer).
_REFUSED_PARAMS = {
    "max_grad_norm": (
        "is not an optimizer parameter in DeepSpeed",
        "remove it; clipping is the top-level gradient_clipping (from --max_grad_norm)",
    ),  # fmt: skip
}


def _validate_named(config: dict, section: str, allowed: tuple, names: tuple[set[str], set[str]], report: Report):
    value = config.get(section)
    if not isinstance(value, dict):
        return  # a non-section was reported when the config was normalized
    for key in value:
        if key not in allowed:
            report.problem(f"{section}.{key}", f"unknown key{schema.did_you_mean(key, allowed)}",
                           schema.unknown_key_fix(key, allowed))  # fmt: skip
    kind = value.get("type")
    any_case, exact = names
    if isinstance(kind, str) and kind.lower() in schema.REMOVED_OPTIMIZERS and section == "optimizer":
        report.problem(f"{section}.type", f"{kind!r}: the 1-bit optimizers were removed from DeepSpeed (0.19)",
                       'use "AdamW" (or "Lamb")')  # fmt: skip
        return
    if not isinstance(kind, str) or (kind.lower() not in any_case and kind not in exact):
        choices = sorted(any_case | exact)
        close = schema.closest(str(kind), choices) or schema.closest(str(kind).lower(), choices)
        hint = f" (did you mean {close!r}?)" if close else ""
        fix = f"use {close!r}" if close else f"use one of {', '.join(choices)}"
        report.problem(f"{section}.type", f"unknown {section} {short(kind)}{hint}", fix)
        return
    params = value.get("params")
    if not isinstance(params, dict):
        return
    if section == "optimizer":
        built, accepted = schema.optimizer_parameters(kind, config)
    else:
        built, accepted = kind, schema.scheduler_parameters(kind)
    if accepted is None:
        return
    for key in params:
        if key in _REFUSED_PARAMS and section == "optimizer":
            report.problem(f"{section}.params.{key}", *_REFUSED_PARAMS[key])
        elif key not in accepted:
            report.problem(
                f"{section}.params.{key}",
                f"{built} has no parameter {key!r}{schema.did_you_mean(key, accepted)} (its constructor would fail)",
                schema.unknown_key_fix(key, accepted),
            )
