"""Checks of a resolved DeepSpeed config beyond filling: named optimizer/scheduler sections (known type, parameters
their constructor accepts), unknown, removed and ZeRO-3-only keys, NVMe paths, then DeepSpeed's own config models."""

from __future__ import annotations

import torch

from ..errors import Report, short
from . import schema, versions
from .fill import BATCH_KEYS, HIDDEN_SIZE_KEYS
from .normalize import GATHER_KEY


def stage3_only(config: dict, stage: int, report: Report):
    zero = config.get("zero_optimization")
    if stage >= 3 or not isinstance(zero, dict):
        return
    for key in [k for k in zero if k in schema.STAGE3_ONLY_KEYS]:
        if zero[key] == "auto":
            zero.pop(key)
            report.change(f"zero_optimization.{key}", "auto", f"ZeRO-3-only key at stage {stage}", "removed")
        elif key != GATHER_KEY or zero[key] is True:
            report.warn(f"zero_optimization.{key} only matters at ZeRO stage 3; it has no effect at stage {stage}")


def validate_named_sections(config: dict, report: Report):
    """optimizer/scheduler: known type, known keys, and params the constructor DeepSpeed calls accepts. Run before
    the leftover-"auto" check, so that a misspelt parameter set to "auto" is reported as misspelt."""
    _validate_named(config, "optimizer", ("type", "params", "legacy_fusion"), _optimizer_names(), report)
    _validate_named(config, "scheduler", ("type", "params"), _scheduler_names(), report)


def validate(config: dict, report: Report) -> list[str]:
    """Every check below; returns the version-dependent rules that applied (:mod:`hf_ext.deepspeed.versions`)."""
    removed = versions.check_removed(config, report)  # each said once, with its release
    applied = [*removed.values(), *versions.check_rules(config, report).values()]
    known = schema.suggestable_top_level_keys()
    for key in config:
        if key not in schema.known_top_level_keys() and key not in removed:
            report.problem(
                key,
                f"unknown top-level key{schema.did_you_mean(key, known)}; DeepSpeed would silently ignore it",
                schema.unknown_key_fix(key, known),
            )
    for section in schema.section_models():
        if isinstance(config.get(section), dict):
            for key, message, fix in schema.section_problems(section, config[section]):
                if key in removed:
                    continue
                if key in HIDDEN_SIZE_KEYS:
                    fix = 'set it to "auto" (from the model\'s hidden size) or a positive integer'
                report.problem(key, message, fix)
    _nvme_paths(config, report)
    reported = {p.key.split(".")[0] for p in report.problems} | set(removed)
    others = [k for k in config if k in schema.known_top_level_keys() and k not in reported and k not in OWN_CHECKS]
    for key, message, fix in schema.key_problems(config, others):
        report.problem(key, message, fix)
    if not report.problems:  # only warnings about removed keys (an older DeepSpeed): the rest checked without them
        for key, message, fix in schema.validate_with_deepspeed(versions.without(config, removed)):
            report.problem(key, message, fix)
    return applied


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
    ),
}


def _validate_named(config: dict, section: str, allowed: tuple, names: tuple[set[str], set[str]], report: Report):
    value = config.get(section)
    if not isinstance(value, dict):
        return  # a non-section was reported when the config was normalized
    for key in value:
        if key not in allowed:
            report.problem(
                f"{section}.{key}",
                f"unknown key{schema.did_you_mean(key, allowed)}",
                schema.unknown_key_fix(key, allowed),
            )
    kind = value.get("type")
    any_case, exact = names
    if isinstance(kind, str) and kind.lower() in versions.REMOVED_OPTIMIZERS and section == "optimizer":
        return  # reported with its release by validate()
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
