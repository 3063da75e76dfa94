"""Rules that hold for some versions only. Each names the release it comes from, the upstream change and the fix, so
that ``hf-ext ds doctor`` can say which DeepSpeed it is talking to and why a key that worked last year fails now.

* **Features DeepSpeed removed** (:data:`REMOVED`): DeepSpeed 0.19.7 and 0.19.8 refuse a config that still holds one
  of them (tracked in deepspeedai/DeepSpeed#8489). Where the installed DeepSpeed refuses the key, it is an error
  naming the release and the pull request that removed it; where an older DeepSpeed is installed, a warning that the
  next release refuses it. DeepSpeed's own tables (``deepspeed.runtime.config._REMOVED_*``) stay the authority on
  what the installed release refuses: a removal they list and this table does not know yet is reported with
  DeepSpeed's own message.
* **Values a release started refusing** (:data:`RULES`): e.g. ``warmup_num_steps: 0`` since DeepSpeed 0.19.3.

The release and pull request of each removal were read from DeepSpeed's sources: 0.19.6 has no removal table, 0.19.7
has the first one (and no 1-bit optimizers), 0.19.8 the full one.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..errors import Report

#: the packages whose versions the doctor prints
PACKAGES = ("deepspeed", "transformers", "accelerate", "torch")
TRACKING_ISSUE = "deepspeedai/DeepSpeed#8489"


@functools.cache
def installed() -> dict[str, Version | None]:
    """The installed version of each of :data:`PACKAGES` (``None``: not installed)."""
    found = {}
    for package in PACKAGES:
        try:
            found[package] = Version(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def describe(versions: Mapping[str, Version | None]) -> str:
    """``deepspeed 0.19.8, transformers 5.23.0, ...``: the first line of the doctor's output."""
    return ", ".join(f"{p} {v if v is not None else '(not installed)'}" for p, v in versions.items())


@dataclass(frozen=True)
class Removal:
    """A DeepSpeed feature removed in ``release`` by ``change`` (a pull request), with what to do instead."""

    release: str
    change: str
    fix: str

    def cite(self) -> str:
        return f"DeepSpeed {self.release}, {self.change}"


_REMOVE = "remove it"
#: dotted config key -> its removal. The 1-bit optimizers are ``optimizer.type`` values: :data:`REMOVED_OPTIMIZERS`.
REMOVED: dict[str, Removal] = {
    "nebula": Removal("0.19.7", "deepspeedai/DeepSpeed#8490",
                      "remove it: checkpoints are written by torch.save (hf-ext writes them atomically)"),
    "compression_training": Removal("0.19.7", "deepspeedai/DeepSpeed#8490", "remove it (the model trains unquantized)"),
    "quantize_training": Removal("0.19.7", "deepspeedai/DeepSpeed#8490", _REMOVE),
    "sparse_attention": Removal("0.19.7", "deepspeedai/DeepSpeed#8493",
                                "remove it; the model's attention is chosen by attn_implementation"),
    "zero_optimization.mics_shard_size": Removal(
        "0.19.7", "deepspeedai/DeepSpeed#8490",
        "remove it; ZeRO++'s zero_optimization.zero_hpz_partition_size keeps a parameter copy per node group"),
    "zero_optimization.mics_hierarchical_params_gather": Removal("0.19.7", "deepspeedai/DeepSpeed#8490", _REMOVE),
    "amp": Removal("0.19.8", "deepspeedai/DeepSpeed#8564", 'remove it; use "bf16" or "fp16" ({"enabled": "auto"})'),
    "sparse_gradients": Removal("0.19.8", "deepspeedai/DeepSpeed#8504",
                                "remove it: an embedding built with sparse=True is still reduced sparsely"),
    "eigenvalue": Removal("0.19.8", "deepspeedai/DeepSpeed#8535", _REMOVE),
    "elasticity": Removal(
        "0.19.8", "deepspeedai/DeepSpeed#8563",
        'remove it and leave the batch keys "auto"; for a run that changes size, launch with torchrun --nnodes '
        "MIN:MAX: hf-ext resumes a checkpoint on any number of ranks with the same global batch (docs/cluster.md)"),
    "graph_harvesting": Removal("0.19.8", TRACKING_ISSUE, _REMOVE),
    "curriculum_learning": Removal("0.19.8", "deepspeedai/DeepSpeed#8566",
                                   "move it to data_efficiency.data_sampling.curriculum_learning"),
    "progressive_layer_drop": Removal("0.19.8", "deepspeedai/DeepSpeed#8562", _REMOVE),
    "zero_optimization.zeropp_loco_param": Removal(
        "0.19.8", "deepspeedai/DeepSpeed#8534",
        "remove it: ZeRO++'s quantized gradients stay, without LoCo's error feedback"),
}  # fmt: skip

#: the 1-bit optimizers (``optimizer.type``, lower-cased as DeepSpeed matched them)
REMOVED_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})
ONE_BIT_REMOVAL = Removal("0.19.7", "deepspeedai/DeepSpeed#8490", 'use "AdamW" (or "Lamb")')


def _lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def without(config: dict, keys) -> dict:
    """``config`` without the dotted ``keys`` (a copy where any is present)."""
    keys = [k for k in keys if _lookup(config, k) is not _MISSING]
    if not keys:
        return config
    config = copy.deepcopy(config)
    for key in keys:
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        del node[leaf]
    return config


def _deepspeed_tables() -> dict[str, str]:
    """The installed DeepSpeed's own removal tables as ``{dotted key: message}`` (empty before 0.19.7)."""
    from deepspeed.runtime import config as ds_config  # noqa: PLC0415 (slow, probes the accelerator: only where its config models are used)

    tables = {k: m for k, m in getattr(ds_config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {}).items()}
    tables |= {f"zero_optimization.{k}": m for k, m in getattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS", {}).items()}
    return {k: m.strip().rstrip(".") for k, m in tables.items()}


def check_removed(
    config: dict, report: Report, versions: Mapping[str, Version | None] | None = None
) -> dict[str, str]:
    """Report every removed feature ``config`` holds (see the module's docstring); returns the rules that applied,
    by dotted key, one line each for the doctor."""
    versions = installed() if versions is None else versions
    deepspeed = versions.get("deepspeed")
    applied = {}
    refused_here = _deepspeed_tables()
    found = [(key, removal) for key, removal in REMOVED.items() if _lookup(config, key) is not _MISSING]
    optimizer = config.get("optimizer")
    kind = optimizer.get("type") if isinstance(optimizer, dict) else None
    if isinstance(kind, str) and kind.lower() in REMOVED_OPTIMIZERS:
        found.append(("optimizer.type", ONE_BIT_REMOVAL))
    for key, removal in found:
        what = f"{kind!r}: the 1-bit optimizers were" if key == "optimizer.type" else "this feature was"
        if deepspeed is None or deepspeed >= Version(removal.release):
            report.problem(key, f"{what} removed in {removal.cite()}", removal.fix)
        else:
            report.warn(
                f"{key}: {what} removed in {removal.cite()}; DeepSpeed {deepspeed} still takes it, the next "
                f"releases refuse it. Fix: {removal.fix}"
            )
        applied[key] = f"{key}: removed in {removal.cite()}"
    for key, message in refused_here.items():  # a removal newer than this table
        if key not in REMOVED and _lookup(config, key) is not _MISSING:
            report.problem(key, f"removed from DeepSpeed: {message}", _REMOVE)
            applied[key] = f"{key}: removed from DeepSpeed {deepspeed} ({TRACKING_ISSUE})"
    return applied


@dataclass(frozen=True)
class VersionRule:
    """A value ``package`` refuses (or mishandles) in the versions ``specifier``, from ``change`` upstream."""

    key: str
    package: str
    specifier: str
    change: str
    applies: Callable[[dict], bool]
    message: str
    fix: str


def _warmup_scheduler_with_zero_warmup(config: dict) -> bool:
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict) or not str(scheduler.get("type", "")).startswith("Warmup"):
        return False
    params = scheduler.get("params")
    return isinstance(params, dict) and params.get("warmup_num_steps") == 0


RULES = (
    VersionRule("scheduler.params.warmup_num_steps", "deepspeed", ">=0.19.3", "deepspeedai/DeepSpeed#8126",
                _warmup_scheduler_with_zero_warmup,
                "0 warm-up steps: DeepSpeed's Warmup schedulers raise 'warmup_num_steps must be a positive integer' "
                "at the engine's start",
                'set it to 1 or more, or "auto" (hf-ext fills at least 1)'),
)  # fmt: skip


def check_rules(config: dict, report: Report, versions: Mapping[str, Version | None] | None = None) -> dict[str, str]:
    """Report each of :data:`RULES` whose package version and config both match; returns those that applied, by
    dotted key."""
    versions = installed() if versions is None else versions
    applied = {}
    for rule in RULES:
        version = versions.get(rule.package)
        if version is None or version not in SpecifierSet(rule.specifier) or not rule.applies(config):
            continue
        report.problem(rule.key, f"{rule.message} ({rule.package}{rule.specifier}, {rule.change})", rule.fix)
        applied[rule.key] = f"{rule.key}: {rule.package}{rule.specifier} ({rule.change})"
    return applied
