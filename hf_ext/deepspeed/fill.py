"""How a DeepSpeed config's keys are filled from ``TrainingArguments`` and the step count: the rules as tables
(:data:`ARG_RULES`, :data:`STEP_RULES`), the values a filled or compared key may take (:data:`VALID_VALUES`), the
batch arithmetic, and helpers on dotted keys. :mod:`hf_ext.deepspeed.resolve` runs them in order."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from ..batching import Layout, split_batch
from ..errors import Report, short
from ..model_info import hidden_size_buckets

HIDDEN_SIZE_KEYS = tuple(f"zero_optimization.{key}" for key in hidden_size_buckets(1))
STEP_KEYS = ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps")


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
    ),
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


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def _batch_arithmetic(config: dict, args, layout: Layout, report: Report) -> bool:
    """An explicit ``train_batch_size`` that ranks x micro-batch x accumulation cannot give (the ranks DeepSpeed
    counts: :attr:`Layout.deepspeed_ranks`), as one problem stating the arithmetic and the settings that satisfy it
    (one fix, not one mismatch after another). True if reported."""
    world = layout.deepspeed_ranks
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
    ranks = layout.ranks(deepspeed=True)
    arithmetic = f"{ranks} x micro-batch {micro} x accumulation {accum} = {world * micro * accum}"
    if total % world:
        report.problem(
            "train_batch_size",
            f"{total} cannot be split over {ranks} ({arithmetic})",
            f'set train_batch_size to "auto" or a multiple of {world}',
        )
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
             lambda args, world: f"world size {world} x per_device_train_batch_size "
                                 f"{args.per_device_train_batch_size} x gradient_accumulation_steps "
                                 f"{args.gradient_accumulation_steps}", add=True,
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


def fill_from_args(config: dict, args, layout: Layout, report: Report):
    """The keys of :data:`ARG_RULES`; the batch keys count the ranks DeepSpeed counts (:attr:`Layout.deepspeed_ranks`:
    all but the sequence-parallel ones)."""
    matched = not _batch_arithmetic(config, args, layout, report)  # else said once, with the arithmetic
    _apply_rules(config, args, layout.deepspeed_ranks, report, ARG_RULES[:3], match=matched)
    _apply_rules(config, args, layout.deepspeed_ranks, report, ARG_RULES[3:])
    if "zero_optimization" not in config:
        config["zero_optimization"] = {"stage": 0}
        report.change(
            "zero_optimization.stage", 0, "DeepSpeed's default (accelerate refuses a config without it)", "added"
        )
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
    report.warn(
        f"scheduler.type {kind} in the config is the schedule that runs: lr_scheduler_type {asked} is ignored "
        f"(transformers builds DeepSpeed's scheduler). Remove the scheduler section to use {asked}{instead}."
    )


def fill_steps(config: dict, args, steps: int, report: Report):
    _apply_rules(config, args, steps, report, STEP_RULES)


def walk(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], node
