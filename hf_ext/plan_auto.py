"""The ``"auto"`` memory choices of a DeepSpeed config, made by :mod:`hf_ext.planner` during config resolution.

``zero_optimization.stage: "auto"``, ``offload_optimizer.device: "auto"``, ``offload_param.device: "auto"`` (all
three in the ``auto`` preset) and ``per_device_train_batch_size="auto"`` resolve to the least-sharded configuration
that fits the per-rank memory budget at the requested micro-batch — or, with the micro-batch ``"auto"``, the largest
micro-batch that fits. The budget is ``memory_per_device`` or detected: accelerator memory on GPUs, available RAM
divided by the local ranks on CPU. The model is ``model`` (when resolving with one) or ``plan_model`` (a path or hub
id; the weights are not read: a random-init copy of its architecture is probed).

Under a launcher only local rank 0 probes; it writes the result to a file the other local ranks read, so every rank
makes the same choice (the detected free RAM differs from one moment to the next).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import planner
from .memory import GiB, current_rss, gb

logger = logging.getLogger("hf_ext.planner")

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str | int | float) -> int:
    """``"8GB"`` → 8e9, ``"8GiB"`` → 8·2³⁰, ``"512MB"``, plain numbers are bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 8GB, 8GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(kw_only=True)
class MemoryPlanArguments:
    """TrainingArguments fields of the memory planner (used when the DeepSpeed config or the batch size is auto)."""

    memory_per_device: str | None = field(
        default=None,
        metadata={"help": "Per-rank memory budget for the planner's auto choices, e.g. 8GB or 7.5GiB (default: "
                  "accelerator memory on GPUs, available RAM / local ranks on CPU)."},
    )  # fmt: skip
    plan_model: str | None = field(
        default=None,
        metadata={"help": "Model path or hub id the planner probes for activation memory (needed when the DeepSpeed "
                  "config or the batch size is auto; the recipe passes --model_name_or_path)."},
    )  # fmt: skip
    plan_seq_len: int = field(
        default=128, metadata={"help": "Sequence length (tokens per example) the memory plan assumes."}
    )
    release_freed_memory: bool | None = field(
        default=None,
        metadata={"help": "On CPU, hand freed memory back to the OS at once: a lower peak RSS (ZeRO-3, 400M shape: "
                  "6.0 instead of 9.5 GiB per rank) for 4x the page faults (2.5 instead of 0.6 million per step). "
                  "Default: on when the memory planner plans the run (an \"auto\" memory key or micro-batch, or "
                  "plan_model), off otherwise."},
    )  # fmt: skip


def _auto_keys(config: dict, args) -> list[str]:
    zero = config.get("zero_optimization")
    keys = []
    if isinstance(zero, dict):
        if zero.get("stage") == "auto":
            keys.append("zero_optimization.stage")
        for section in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(section), dict) and zero[section].get("device") == "auto":
                keys.append(f"zero_optimization.{section}.device")
    if getattr(args, "per_device_train_batch_size", None) == "auto":
        keys.append("per_device_train_batch_size")
    return keys


def _precision(config: dict, args, hardware) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    for name in ("bf16", "fp16"):
        if isinstance(config.get(name), dict) and config[name].get("enabled") is True:
            return name
    return hardware.default_precision() or "fp32"


def detect_budget(device: str) -> int:
    """Per-rank memory: total accelerator memory (less a reserve) on GPUs, available RAM / local ranks on CPU."""
    from .runtime import local_world_size

    if device != "cpu":
        import torch

        index = int(os.environ.get("LOCAL_RANK", "0") or 0)
        return int(torch.cuda.get_device_properties(index).total_memory)
    import psutil

    return int(psutil.virtual_memory().available // local_world_size())


def _shared_file(key: str) -> Path | None:
    """A file all local ranks of this launch agree on (``None`` when not under a launcher)."""
    if "LOCAL_RANK" not in os.environ:
        return None
    launch = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}-{key}"
    return Path(tempfile.gettempdir()) / f"hf_ext_plan_{hashlib.sha1(launch.encode()).hexdigest()[:16]}.json"


def _probe_or_wait(compute, key: str, timeout: float = 3600.0) -> dict:
    path = _shared_file(key)
    if path is None:
        return compute()
    if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:
        data = compute()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
        return data
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"local rank 0 did not write the memory plan to {path}")
        time.sleep(0.2)
    return json.loads(path.read_text())


def _load_model(model):
    """A model to probe: ``model`` itself, or a random-init copy of the architecture ``model`` names."""
    if hasattr(model, "parameters"):
        return model, False
    import torch
    import transformers
    from transformers import AutoConfig, PretrainedConfig

    config = model if isinstance(model, PretrainedConfig) else AutoConfig.from_pretrained(str(model))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        from transformers import AutoModel

        cls = AutoModel
        return cls.from_config(config), True
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return cls._from_config(config), True


def measure(model, seq_len: int, checkpointing: bool) -> dict:
    """Model facts and activation profile of ``model`` (object, config or path) as a JSON-able dict."""
    import gc

    probe_model, built = _load_model(model)
    facts = planner.model_facts(probe_model)
    profile = planner.probe_activations(probe_model, seq_len, (1, 2), checkpointing)
    if built:
        del probe_model
        gc.collect()
    return {"facts": facts.__dict__, "seq_len": seq_len, "checkpointing": checkpointing, "points": profile.points}


def from_measurement(data: dict) -> tuple[planner.ModelFacts, planner.ActivationProfile]:
    facts = planner.ModelFacts(**data["facts"])
    points = [tuple(p) for p in data["points"]]
    return facts, planner.ActivationProfile(data["seq_len"], data["checkpointing"], points)


def _candidate_of(config: dict) -> planner.Candidate:
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero.get("stage", 0), int) else 0

    def on(section):
        value = zero.get(section)
        return isinstance(value, dict) and value.get("device") not in (None, "none", "auto")

    return planner.Candidate(stage, on("offload_optimizer") and stage > 0, on("offload_param") and stage == 3)


def resolve_auto(config: dict, args, model, world: int, hardware, report, resolution) -> None:
    """Fill the memory ``"auto"`` keys of ``config`` (and an ``"auto"`` micro-batch in ``args``) in place.

    Also computes the plan of an explicit config when ``args.plan_model`` is set, so that it is logged at train
    start. The plan is kept in ``args.hf_ext_memory_plan``.
    """
    keys = _auto_keys(config, args)
    if not keys and getattr(args, "plan_model", None) is None:
        return  # nothing to choose and no plan asked for: no probe
    model = model if model is not None else getattr(args, "plan_model", None)
    if model is None:
        for key in keys:
            report.problem(key, '"auto" needs the model to plan memory', "pass plan_model=PATH (--plan_model PATH)")
        return
    checkpointing = bool(
        getattr(args, "activation_checkpointing", False)
        or getattr(args, "gradient_checkpointing", False)
        or resolution.args_updates.get("activation_checkpointing")
    )
    seq_len = int(getattr(args, "plan_seq_len", 128) or 128)
    precision = _precision(config, args, hardware)
    budget_text = getattr(args, "memory_per_device", None)
    model_key = model if isinstance(model, (str, Path)) else type(model).__name__
    baseline = current_rss() if hardware.device == "cpu" else planner.GPU_RESERVE

    def compute():
        data = measure(model, seq_len, checkpointing)
        data["budget"] = parse_bytes(budget_text) if budget_text else detect_budget(hardware.device)
        data["baseline"] = baseline
        return data

    data = _probe_or_wait(compute, f"{model_key}-{seq_len}-{checkpointing}-{budget_text}")
    facts, profile = from_measurement(data)
    budget, baseline = int(data["budget"]), int(data["baseline"])
    source = f"--memory_per_device {budget_text}" if budget_text else f"detected on {hardware.device}"
    zero = config.setdefault("zero_optimization", {})
    micro = None if args.per_device_train_batch_size == "auto" else int(args.per_device_train_batch_size)
    common = dict(precision=precision, zero=zero, device=hardware.device, baseline=baseline)
    common["accumulation_steps"] = getattr(args, "gradient_accumulation_steps", 1) or 1
    if "zero_optimization.stage" in keys or any("offload" in k for k in keys):
        candidates = _allowed(zero, keys)
        chosen, plans = planner.choose(facts, profile, world, budget, micro, candidates, **common)
        if chosen is None:
            smallest = min(plans, key=lambda p: p.total_bytes)
            report.problem(
                keys[0],
                f"nothing fits the {gb(budget)} per rank ({source}): the smallest plan, {smallest.candidate.name} at "
                f"micro-batch {smallest.micro_batch}, needs {gb(smallest.total_bytes + baseline)}",
                "lower per_device_train_batch_size or plan_seq_len, turn on activation checkpointing, add ranks, "
                "or raise memory_per_device",
            )
            _apply(config, smallest, keys, report, source)  # so that the only error is the one above
            if micro is None:
                args.per_device_train_batch_size = 1
            resolution.memory_plan = None
            return
    else:
        candidate = _candidate_of(config)
        batch = micro or max(1, planner.max_micro_batch(candidate, facts, profile, world, budget, **common))
        chosen = planner.plan(candidate, facts, profile, world, batch, budget=budget, **common)
    _apply(config, chosen, keys, report, source)
    if micro is None:
        args.per_device_train_batch_size = chosen.micro_batch
        resolution.args_updates["per_device_train_batch_size"] = chosen.micro_batch
        report.change("TrainingArguments.per_device_train_batch_size", chosen.micro_batch, f"planner: largest micro-batch that fits ({source})")  # fmt: skip
    try:
        args.hf_ext_memory_plan = chosen
    except AttributeError:  # pragma: no cover - frozen arguments
        pass
    resolution.memory_plan = chosen


def _allowed(zero: dict, keys: list[str]) -> list[planner.Candidate]:
    """Candidates compatible with what the config fixes (an explicit stage or offload device)."""
    out = []
    for c in planner.CANDIDATES:
        if "zero_optimization.stage" not in keys and c.stage != zero.get("stage"):
            continue
        for section, flag in (("offload_optimizer", c.offload_optimizer), ("offload_param", c.offload_param)):
            value = zero.get(section)
            fixed = isinstance(value, dict) and value.get("device") not in ("auto",)
            if fixed and flag != (value.get("device") not in (None, "none")):
                break
        else:
            out.append(c)
    return out


def _apply(config: dict, plan: planner.Plan, keys: list[str], report, source: str) -> None:
    zero = config["zero_optimization"]
    c = plan.candidate
    why = f"planner: {c.name} fits {gb(plan.total_bytes + plan.baseline)} of {gb(plan.budget)} per rank ({source})"
    if "zero_optimization.stage" in keys:
        zero["stage"] = c.stage
        report.change("zero_optimization.stage", c.stage, why)
        if c.stage < 3:  # the stage-3 settings of the auto preset do not apply
            from .ds_schema import STAGE3_ONLY_KEYS

            for key in [k for k in zero if k in STAGE3_ONLY_KEYS and k != "offload_param"]:
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


__all__ = ["MemoryPlanArguments", "GiB", "detect_budget", "measure", "parse_bytes", "resolve_auto"]
