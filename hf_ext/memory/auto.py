"""The ``"auto"`` memory choices, decided by the planner: the least-sharded ZeRO stage and offload that fit the
per-rank memory budget at the requested micro-batch, or, with the micro-batch ``"auto"``, the largest micro-batch that
fits. :func:`decide` returns a :class:`MemoryDecision`; the DeepSpeed config resolver writes it into the config.

The budget is ``memory_per_device`` or detected by :func:`detect_budget`: accelerator memory on GPUs, available RAM
divided by the ranks **on this node** on CPU. Available RAM is a per-node quantity shared by the node's ranks only;
dividing it by the world size would under-count it on every multi-node run. ``hf-ext ds plan`` and ``"auto"`` in a
config both call :func:`detect_budget` (the CLI with ``--nproc_per_node``, by default the world size: one node).

The probe (a model built and run forward and backward) runs once per process and per key, and once per node under a
launcher: the first local rank to take the key's file lock probes and writes the result; the others wait on the lock
(the kernel releases it if that rank dies, and the next one probes) and read the same result, so every rank makes the
same choice (the detected free RAM differs from one moment to the next). No collective is involved: planning happens
before the process group exists, when ``TrainingArguments`` are built.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from ..atomic import write_text_atomically
from ..runtime import host_memory_per_rank, local_rank
from ..sizes import gb, parse_bytes
from . import formulas
from .measure import current_rss
from .probe import from_measurement, measure

#: the config keys (and the TrainingArguments field) whose "auto" the planner fills
STAGE_KEY = "zero_optimization.stage"
OFFLOAD_KEYS = ("zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device")
MICRO_BATCH_KEY = "per_device_train_batch_size"


def auto_keys(config: dict, per_device_train_batch_size) -> list[str]:
    """The memory keys left to the planner: an ``"auto"`` stage, offload device or micro-batch."""
    zero = config.get("zero_optimization")
    keys = []
    if isinstance(zero, dict):
        if zero.get("stage") == "auto":
            keys.append(STAGE_KEY)
        for section in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(section), dict) and zero[section].get("device") == "auto":
                keys.append(f"zero_optimization.{section}.device")
    if per_device_train_batch_size == "auto":
        keys.append(MICRO_BATCH_KEY)
    return keys


def detect_budget(device: str, local_ranks: int) -> int:
    """Per-rank memory: total accelerator memory on GPUs, available RAM / ``local_ranks`` (ranks on this node) on
    CPU."""
    if device != "cpu":
        return int(torch.cuda.get_device_properties(local_rank() or 0).total_memory)
    return host_memory_per_rank(local_ranks)


def process_baseline(device: str) -> int:
    """Memory the process holds before training: its resident set on CPU, a fixed reserve on GPUs."""
    return current_rss() if device == "cpu" else formulas.GPU_RESERVE


def _shared_file(key: str) -> Path | None:
    """A file all local ranks of this launch agree on (``None`` when not under a launcher)."""
    if local_rank() is None:
        return None
    launch = f"{os.getppid()}-{os.environ.get('MASTER_PORT', '')}-{key}"
    return Path(tempfile.gettempdir()) / f"hf_ext_plan_{hashlib.sha1(launch.encode()).hexdigest()[:16]}.json"


#: measurements this process made or read, by probe key: a second ``TrainingArguments`` (the trainer's copy, a
#: sweep) plans from them without building the model again
_MEASURED: dict[str, dict] = {}


def measured_once(compute, key: str, remember: bool = True) -> dict:
    """``compute()``'s result for ``key``: computed once per node under a launcher (the first local rank to lock the
    key's file computes and writes it; the others block on the lock, then read it), and, with ``remember``, once per
    process."""
    if remember and key in _MEASURED:
        return _MEASURED[key]
    path = _shared_file(key)
    if path is None:
        data = compute()
    else:
        # an OS lock (flock / LockFileEx): released by the kernel when the holder exits, whatever happened
        with FileLock(path.with_suffix(".lock")):
            if path.exists():
                data = json.loads(path.read_text())
            else:
                data = compute()
                write_text_atomically(path, json.dumps(data))
    if remember:
        _MEASURED[key] = data
    return data


def probe_key(model) -> tuple[str, bool]:
    """What identifies ``model``'s measurement, and whether it stays valid for the whole process: a path or hub id
    and a config do; a model object is measured as it is now (its trainable parameters may change), so it is keyed
    by its class for the ranks of one launch only."""
    if isinstance(model, (str, Path)):
        local = Path(model)
        return (str(local.resolve()) if local.exists() else str(model)), True
    if hasattr(model, "to_json_string"):  # a config
        digest = hashlib.sha1(model.to_json_string(use_diff=False).encode()).hexdigest()[:16]
        return f"{type(model).__name__}-{digest}", True
    return type(model).__name__, False


def candidate_of(config: dict) -> formulas.Candidate:
    """The planner's candidate (stage, offloads) that a resolved config runs."""
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero.get("stage", 0), int) else 0

    def on(section):
        value = zero.get(section)
        return isinstance(value, dict) and value.get("device") not in (None, "none", "auto")

    return formulas.Candidate(stage, on("offload_optimizer") and stage > 0, on("offload_param") and stage == 3)


def _allowed(zero: dict, keys: list[str]) -> list[formulas.Candidate]:
    """Candidates compatible with what the config fixes (an explicit stage or offload device)."""
    out = []
    for c in formulas.CANDIDATES:
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


@dataclass
class MemoryDecision:
    """What the planner chose: ``plan`` fits the budget (``None`` when nothing does; ``smallest`` is then the plan
    that needs least memory), ``budget_source`` says where the budget came from."""

    plan: formulas.Plan | None
    smallest: formulas.Plan | None
    budget_source: str
    keys: list[str]


def decide(
    config: dict,
    keys: list[str],
    model,
    *,
    world_size: int,
    local_ranks: int,
    precision: str,
    device: str,
    micro_batch: int | None,
    accumulation_steps: int = 1,
    seq_len: int = 128,
    checkpointing: bool = False,
    memory_per_device: str | None = None,
) -> MemoryDecision:
    """Plan the run of ``model`` (a model, a config or a path) under ``config``'s ZeRO section, choosing what
    ``keys`` leave open (see :func:`auto_keys`); nothing in ``config`` is changed."""
    zero = config.get("zero_optimization") or {}
    model_key, remember = probe_key(model)
    baseline = process_baseline(device)

    def compute():
        data = measure(model, seq_len, checkpointing)
        data["budget"] = parse_bytes(memory_per_device) if memory_per_device else detect_budget(device, local_ranks)
        data["baseline"] = baseline
        return data

    data = measured_once(compute, f"{model_key}-{seq_len}-{checkpointing}-{memory_per_device}", remember)
    facts, profile = from_measurement(data)
    budget, baseline = int(data["budget"]), int(data["baseline"])
    source = f"--memory_per_device {memory_per_device}" if memory_per_device else f"detected on {device}"
    common = dict(precision=precision, zero=zero, device=device, baseline=baseline)
    common["accumulation_steps"] = accumulation_steps or 1
    if STAGE_KEY in keys or any(key in OFFLOAD_KEYS for key in keys):
        chosen, plans = formulas.choose(
            facts, profile, world_size, budget, micro_batch, _allowed(zero, keys), **common
        )
        smallest = min(plans, key=lambda p: p.total_bytes) if chosen is None and plans else None
        return MemoryDecision(chosen, smallest, source, keys)
    candidate = candidate_of(config)
    batch = micro_batch or max(1, formulas.max_micro_batch(candidate, facts, profile, world_size, budget, **common))
    chosen = formulas.plan(candidate, facts, profile, world_size, batch, budget=budget, **common)
    return MemoryDecision(chosen, None, source, keys)


def describe_choice(plan: formulas.Plan, source: str) -> str:
    c = plan.candidate
    return f"planner: {c.name} fits {gb(plan.total_bytes + plan.baseline)} of {gb(plan.budget)} per rank ({source})"
