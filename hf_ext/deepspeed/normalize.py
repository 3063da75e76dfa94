"""Normalizations of a raw DeepSpeed config that need no TrainingArguments and no model.

Each one turns a spelling that DeepSpeed or transformers read differently (or silently drop) into the one both read
the same way, and records what it did:

* keys with stray whitespace (``" stage"``) are stripped; ``_comment``-style keys (a JSON comment workaround) dropped;
* the old ``bfloat16`` section becomes ``bf16``;
* ZeRO keys written at top level (``"stage3_gather_16bit_weights_on_model_save": true`` next to
  ``zero_optimization``) move into ``zero_optimization``;
* deprecated ``cpu_offload`` / ``cpu_offload_param`` / ``cpu_offload_use_pin_memory`` become ``offload_optimizer``
  / ``offload_param`` sections (transformers only recognises offload through those);
* ``stage3_gather_fp16_weights_on_model_save`` and the unprefixed ``gather_16bit_weights_on_model_save`` become
  ``stage3_gather_16bit_weights_on_model_save``, the only spelling transformers reads when saving;
* string booleans (``"true"``) become booleans (transformers treats the string ``"false"`` as true); in the fields
  DeepSpeed declares boolean, every spelling its config models read as one (``"yes"``, ``"off"``, ``1``) does too
  (hf-ext and transformers compare with ``True``, DeepSpeed coerces: they would disagree);
* float literals in integer fields (``1e9``, ``2e8``) become integers; numbers written as strings in float fields
  (``"1e9"``) become numbers.

And what no spelling rescues is refused, naming the key: a section that is not an object, a deprecated offload flag
next to the section that replaced it (DeepSpeed refuses the pair), a boolean, non-integral, non-finite or
out-of-range number in an integer field.
"""

from __future__ import annotations

import math

from ..errors import Report, short
from . import schema

GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"
GATHER_ALIASES = ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save")


def is_comment_key(key: str) -> bool:
    return key.startswith(("_", "//", "#")) or key.lower() in ("comment", "comments")


def normalize(config: dict) -> tuple[dict, Report]:
    """A normalized copy of ``config`` and the report of every change (problems for unresolvable conflicts)."""
    report = Report()
    config = _strip_keys(config, "", report)
    _rename_section(config, "bfloat16", "bf16", report)
    _zero_section(config, report)
    _section_shapes(config, report)
    _move_misplaced_zero_keys(config, report)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _offload_flags(zero, report)
        _gather_aliases(zero, report)
    _booleans(config, report)
    _auto_spelling(config, report)
    _integer_fields(config, report)
    _float_fields(config, report)
    return config, report


def _strip_keys(node, prefix: str, report: Report):
    if isinstance(node, list):
        return [_strip_keys(v, prefix, report) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict = {}
    for key, value in node.items():
        clean = key.strip() if isinstance(key, str) else key
        if isinstance(clean, str) and is_comment_key(clean):
            report.change(prefix + clean, value, "comment key (DeepSpeed ignores it)", "removed")
            continue
        if clean != key:
            report.change(prefix + clean, value, f"key {key!r} had stray whitespace", "normalized")
            if clean in node or clean in out:
                report.problem(prefix + clean, f"given twice (as {key!r} and {clean!r})", "keep one of them")
                continue
        out[clean] = _strip_keys(value, f"{prefix}{clean}.", report)
    return out


def _rename_section(config: dict, old: str, new: str, report: Report):
    if old not in config:
        return
    value = config.pop(old)
    if new in config and config[new] != value:
        report.problem(new, f"both {old!r} (old name) and {new!r} sections are present and differ", f"drop {old!r}")
        return
    config[new] = value
    report.change(new, value, f"section {old!r} renamed (old DeepSpeed name)", "normalized")


def _zero_section(config: dict, report: Report):
    zero = config.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's deprecated boolean form
        config["zero_optimization"] = {"stage": 1 if zero else 0}
        report.change(
            "zero_optimization.stage", 1 if zero else 0, "deprecated boolean zero_optimization", "normalized"
        )


#: Sections hf-ext reads itself, and what each must look like.
SECTIONS = {
    "zero_optimization": '{"stage": 2}',
    "fp16": '{"enabled": true}',
    "bf16": '{"enabled": true}',
    "optimizer": '{"type": "AdamW", "params": {"lr": "auto"}}',
    "scheduler": '{"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}',
    "optimizer.params": '{"lr": "auto"}',
    "scheduler.params": '{"warmup_num_steps": "auto"}',
}


def _section_shapes(config: dict, report: Report):
    """A section that is not an object is one problem naming it, and is left out so that nothing else trips on it."""
    for key, example in SECTIONS.items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node or isinstance(node[leaf], dict):
            continue
        value = node.pop(leaf)
        report.problem(key, f"must be a section (a JSON object), got {short(value)}", f"write it like {example}")


def _move_misplaced_zero_keys(config: dict, report: Report):
    misplaced = [k for k in config if k in schema.zero_keys()]
    if not misplaced:
        return
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        return
    for key in misplaced:
        value = config.pop(key)
        if key in zero and zero[key] != value:
            report.problem(
                f"zero_optimization.{key}",
                f"set both at top level ({short(value)}) and inside zero_optimization ({short(zero[key])})",
                "keep the one inside zero_optimization",
            )
            continue
        zero[key] = value
        report.change(f"zero_optimization.{key}", value, "ZeRO key found at top level", "moved")


def _offload_flags(zero: dict, report: Report):
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    for flag, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if flag not in zero:
            continue
        if section in zero:  # DeepSpeed's config model refuses a deprecated field next to its replacement
            zero.pop(flag)
            report.problem(
                f"zero_optimization.{flag}",
                f"deprecated spelling of {section}, given together with it (DeepSpeed refuses the pair)",
                f"remove {flag}: the {section} section says where the state goes",
            )
            continue
        enabled = as_bool(zero.pop(flag), declared_bool=True)
        if not enabled:
            report.change(f"zero_optimization.{flag}", False, "deprecated flag, false: nothing to offload", "removed")
            continue
        target = zero[section] = {"device": "cpu"}
        if pin is not None:
            target["pin_memory"] = as_bool(pin, declared_bool=True)
        report.change(f"zero_optimization.{section}", target, f"deprecated {flag}: true", "normalized")
    if pin is not None and not any(s in zero for s in ("offload_optimizer", "offload_param")):
        report.change("zero_optimization.cpu_offload_use_pin_memory", pin, "deprecated, nothing offloaded", "removed")


def _gather_aliases(zero: dict, report: Report):
    for alias in GATHER_ALIASES:
        if alias not in zero:
            continue
        value = zero.pop(alias)
        if GATHER_KEY in zero and zero[GATHER_KEY] != value:
            report.problem(
                f"zero_optimization.{GATHER_KEY}",
                f"{alias}={short(value)} contradicts {GATHER_KEY}={short(zero[GATHER_KEY])}",
                f"drop {alias}",
            )
            continue
        zero[GATHER_KEY] = value
        report.change(
            f"zero_optimization.{GATHER_KEY}", value, f"renamed from {alias} (transformers reads only {GATHER_KEY})"
        )
        report.changes[-1].action = "normalized"


#: The one table of boolean spellings: the strings pydantic (DeepSpeed's config models) reads as booleans.
BOOLEAN_WORDS = {
    **dict.fromkeys(("true", "yes", "on", "y", "t", "1"), True),
    **dict.fromkeys(("false", "no", "off", "n", "f", "0"), False),
}


def as_bool(value, declared_bool: bool = False):
    """``value`` as a boolean when it spells one. ``"true"``/``"false"`` count anywhere (transformers tests such
    strings for truth, so ``"false"`` would turn a feature on); the other spellings and 0/1 only where DeepSpeed
    declares a boolean (``declared_bool``): elsewhere they may be a real string or number."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "false") or (declared_bool and word in BOOLEAN_WORDS):
            return BOOLEAN_WORDS[word]
    elif declared_bool and type(value) is int and value in (0, 1):
        return bool(value)
    return value


def _leaves(node, prefix: str = ""):
    """``(parent, key, dotted path, value)`` of every non-section value below ``node`` (a snapshot: the caller may
    replace or drop the value)."""
    if not isinstance(node, dict):
        return
    for key, value in list(node.items()):
        path = prefix + str(key)
        if isinstance(value, dict):
            yield from _leaves(value, f"{path}.")
        else:
            yield node, key, path, value


def _booleans(config: dict, report: Report):
    bool_fields = schema.typed_fields("bool")
    for parent, key, path, value in _leaves(config):
        read = as_bool(value, declared_bool=path in bool_fields)
        if read is not value and isinstance(read, bool):
            parent[key] = read
            report.change(path, read, f"{short(value)} read as a boolean", "normalized")


def _auto_spelling(config: dict, report: Report):
    for parent, key, path, value in _leaves(config):
        if isinstance(value, str) and value != "auto" and value.strip().lower() == "auto":
            parent[key] = "auto"
            report.change(path, "auto", f"{value!r} spelled as 'auto'", "normalized")


#: DeepSpeed and torch keep integer settings in 64-bit integers.
INT64_MAX = 2**63 - 1


def _number(value):
    """``value`` as a number when it is one or a string spelling one (``None`` otherwise)."""
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None  # not a number at all: DeepSpeed's config model names it
    return value if isinstance(value, (int, float)) else None


def _integer_fields(config: dict, report: Report):
    int_fields = schema.typed_fields("int")
    for parent, key, path, value in _leaves(config):
        number = _number(value) if path in int_fields else None
        if number is None:
            continue
        if isinstance(number, bool):
            parent.pop(key)
            report.problem(
                path,
                f"is a boolean ({short(value)}) where DeepSpeed wants an integer",
                f"write the number you mean (DeepSpeed would read {short(value)} as {int(number)})",
            )
        elif not math.isfinite(number):
            parent.pop(key)
            report.problem(path, f"is {short(value)}, not a finite number", "write an integer")
        elif abs(number) > INT64_MAX:
            parent.pop(key)
            report.problem(
                path,
                f"{short(value)} does not fit a 64-bit integer",
                "use a realistic integer or remove it to use DeepSpeed's default",
            )
        elif not float(number).is_integer():
            parent.pop(key)
            hint = f" such as {max(1, round(number))}" if number > 0 else ""
            report.problem(path, f"{short(value)} is not an integer", f"use an integer{hint}")
        elif number is not value or isinstance(value, float):
            parent[key] = int(number)
            report.change(path, parent[key], f"{short(value)} read as an integer", "normalized")


def _float_fields(config: dict, report: Report):
    """A number written as a string (``"1e9"``) in a field DeepSpeed declares float becomes that number."""
    float_fields = schema.typed_fields("float")
    for parent, key, path, value in _leaves(config):
        number = _number(value) if isinstance(value, str) and path in float_fields else None
        if number is not None and math.isfinite(number):
            parent[key] = number
            report.change(path, number, f"{short(value)} read as a number", "normalized")
