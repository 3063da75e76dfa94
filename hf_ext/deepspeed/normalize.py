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
* string booleans (``"true"``) become booleans (transformers treats the string ``"false"`` as true);
* float literals in integer fields (``1e9``, ``2e8``) become integers (DeepSpeed rejects non-integral floats).
"""

from __future__ import annotations

import math

from . import schema
from .errors import Report, short

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
    _move_misplaced_zero_keys(config, report)
    zero = config.get("zero_optimization")
    if isinstance(zero, dict):
        _offload_flags(zero, report)
        _gather_aliases(zero, report)
    _string_booleans(config, "", report)
    _auto_spelling(config, "", report)
    _integer_fields(config, "", report)
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
        enabled = _as_bool(zero.pop(flag))
        if not enabled:
            report.change(f"zero_optimization.{flag}", False, "deprecated flag, false: nothing to offload", "removed")
            continue
        if isinstance(zero.get(section), dict) and zero[section].get("device", "none") not in ("none", "cpu"):
            report.problem(
                f"zero_optimization.{section}",
                f"deprecated {flag}=true conflicts with {section}.device={zero[section]['device']!r}",
                f"drop {flag}",
            )
            continue
        target = zero.setdefault(section, {}) if isinstance(zero.get(section), dict) else {}
        zero[section] = target
        target["device"] = "cpu"
        if pin is not None:
            target.setdefault("pin_memory", _as_bool(pin))
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


def _as_bool(value):
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def _string_booleans(node, prefix: str, report: Report):
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if isinstance(value, dict):
            _string_booleans(value, f"{prefix}{key}.", report)
        elif isinstance(value, str) and value.strip().lower() in ("true", "false"):
            node[key] = _as_bool(value)
            report.change(prefix + key, node[key], f"string {value!r} read as a boolean", "normalized")


def _auto_spelling(node, prefix: str, report: Report):
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if isinstance(value, dict):
            _auto_spelling(value, f"{prefix}{key}.", report)
        elif isinstance(value, str) and value != "auto" and value.strip().lower() == "auto":
            node[key] = "auto"
            report.change(prefix + key, "auto", f"{value!r} spelled as 'auto'", "normalized")


def _integer_fields(node, prefix: str, report: Report):
    if not isinstance(node, dict):
        return
    int_fields = schema.typed_fields("int")
    for key, value in node.items():
        path = prefix + key
        if isinstance(value, dict):
            _integer_fields(value, f"{path}.", report)
        elif isinstance(value, str) and path in int_fields:
            try:
                number = float(value.strip())
            except ValueError:
                continue
            node[key] = int(number) if math.isfinite(number) else value
            report.change(path, node[key], f"string {value!r} read as an integer", "normalized")
        elif isinstance(value, float) and path in int_fields and math.isfinite(value):
            node[key] = int(value)
            if value.is_integer():
                report.change(path, node[key], f"float literal {value!r} in an integer field", "normalized")
            else:
                report.change(path, node[key], f"non-integral {value!r} truncated (DeepSpeed wants an integer)")
                report.changes[-1].action = "normalized"
                report.warn(f"{path}: {value!r} is not an integer; using {node[key]}")
