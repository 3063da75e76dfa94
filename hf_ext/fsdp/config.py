"""FSDP settings (``fsdp`` / ``fsdp_config`` of ``TrainingArguments``) resolved before stock reads them.

Stock transformers translates ``fsdp``/``fsdp_config`` into accelerate's FSDP plugin, passes unknown keys over in
silence, refuses ``hybrid_shard`` under FSDP2 (the default) and has no ``no_shard`` either. hf-ext adds:

* three presets, named as stock's ``fsdp`` strings: ``full_shard`` (every parameter, gradient and optimizer state
  split over all ranks), ``hybrid_shard`` (split inside groups of ``sharding_factor`` ranks, replicated across the
  groups: FSDP2 on a 2-D device mesh) and ``no_shard`` (replicated everywhere: that is DDP, which is what runs);
* ``sharding_factor`` in ``fsdp_config`` (``"auto"``: the ranks of one node, so that the shards' all-gathers stay
  inside a node and only the gradient all-reduce crosses nodes);
* every ``"auto"`` filled, and all problems raised at once, one line each with the fix (:class:`FsdpConfigError`).

:func:`resolve_fsdp` is pure (unit-tested); ``hf_ext.training_args`` applies its result.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser

from ..errors import Change, FsdpConfigError, Problem

PRESETS = ("full_shard", "hybrid_shard", "no_shard")
#: ``fsdp`` words stock transformers accepts (``transformers.trainer_utils.FSDPOption``)
STOCK_WORDS = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2", "offload", "auto_wrap")
#: ``fsdp_config`` keys stock transformers reads (``TrainingArguments._process_fsdp_args``), and hf-ext's own
STOCK_KEYS = frozenset(
    {
        "version",
        "cpu_offload",
        "auto_wrap_policy",
        "min_num_params",
        "transformer_layer_cls_to_wrap",
        "cpu_ram_efficient_loading",
        "state_dict_type",
        "activation_checkpointing",
        "reshard_after_forward",
        "forward_prefetch",
        "backward_prefetch",
        "use_orig_params",
        "sync_module_states",
        "limit_all_gathers",
        "xla",
        "xla_fsdp_v2",
        "xla_fsdp_settings",
        "xla_fsdp_grad_ckpt",
    }
)
HF_EXT_KEYS = frozenset({"sharding_factor"})
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: checkpoints: each rank writes its own shards (torch.distributed.checkpoint);
#: FULL_STATE_DICT would gather the whole model and optimizer state on rank 0 at every checkpoint
DEFAULT_STATE_DICT_TYPE = "SHARDED_STATE_DICT"
#: refused wherever FSDP settings arrive (the arguments here, accelerate launch's in hf_ext.fsdp.engine)
FSDP1_ON_CPU = Problem(
    "fsdp_config.version",
    "FSDP1 does not run on CPU-only ranks (and is deprecated)",
    "remove `version` (FSDP2 is the default), or set it to 2",
)


@dataclass
class FsdpResolution:
    """What :func:`resolve_fsdp` decided: the values stock reads, and the sharding as the run summary names it."""

    sharding: str  # full_shard | shard_grad_op | hybrid_shard | no_shard
    fsdp: bool | None  # the value for stock ``fsdp`` (None: no FSDP, i.e. DDP)
    fsdp_config: dict = field(default_factory=dict)
    sharding_factor: int | None = None  # ranks one parameter is split over
    replicas: int = 1  # copies of each shard (hybrid: world size / sharding factor)
    changes: list[Change] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def hybrid(self) -> bool:
        return self.fsdp is not None and self.replicas > 1


def _words(fsdp: Any) -> list[str]:
    if fsdp is True or (isinstance(fsdp, str) and fsdp.strip().lower() in ("true", "1", "")):
        return ["full_shard"]
    if isinstance(fsdp, str):
        return fsdp.split()
    return [str(word) for word in fsdp]


def _load_config(fsdp_config: Any, problems: list[Problem]) -> dict:
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, (str, Path)):
        path = Path(fsdp_config)
        try:
            fsdp_config = json.loads(path.read_text())
        except FileNotFoundError:
            problems.append(Problem("fsdp_config", f"no such file {str(path)!r}", "pass an existing JSON file"))
            return {}
        except json.JSONDecodeError as err:
            problems.append(Problem("fsdp_config", f"{path} is not valid JSON ({err})", "fix the JSON syntax"))
            return {}
    if not isinstance(fsdp_config, dict):
        problems.append(Problem("fsdp_config", f"expected a dict or a JSON path, got {type(fsdp_config).__name__}"))
        return {}
    # stock strips the ``fsdp_`` prefix accelerate's names carry; do the same before checking names
    return {(key[5:] if key.startswith("fsdp_") else key): value for key, value in fsdp_config.items()}


def _factor(value: Any, world_size: int, local_world_size: int, problems: list[Problem]) -> tuple[int | None, str]:
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if value in (None, "auto"):
        return min(local_world_size, world_size), f"auto: the {min(local_world_size, world_size)} ranks of a node"
    try:
        factor = int(value)
    except (TypeError, ValueError):
        factor = 0
    if factor < 1 or world_size % factor:
        problems.append(
            Problem(
                "fsdp_config.sharding_factor",
                f"{value!r} does not divide the {world_size} ranks into equal groups",
                f'set it to one of {", ".join(map(str, divisors))} (or "auto": the ranks of one node)',
            )
        )
        return None, ""
    return factor, "fsdp_config"


def resolve_fsdp(
    fsdp: Any,
    fsdp_config: Any = None,
    *,
    world_size: int = 1,
    local_world_size: int = 1,
    deepspeed: Any = None,
    has_accelerator: bool = False,
) -> FsdpResolution:
    """Check and complete FSDP settings for a run on ``world_size`` ranks (``local_world_size`` per node).

    Raises :class:`FsdpConfigError` with every problem found, one line each with its fix.
    """
    problems: list[Problem] = []
    changes: list[Change] = []
    warnings: list[str] = []
    words = _words(fsdp)
    config = _load_config(fsdp_config, problems)

    unknown_words = [w for w in words if w not in STOCK_WORDS]
    for word in unknown_words:
        close = difflib.get_close_matches(word, STOCK_WORDS, n=1)
        fix = f"did you mean {close[0]!r}? " if close else ""
        problems.append(Problem("fsdp", f"unknown option {word!r}", f"{fix}use one of {', '.join(PRESETS)}"))
    shardings = [
        w for w in words if w in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
    ]
    if len(set(shardings)) > 1:
        problems.append(Problem("fsdp", f"several sharding strategies: {' '.join(shardings)}", "keep one of them"))
    sharding = shardings[0] if shardings else "full_shard"
    if sharding == "hybrid_shard_zero2":
        problems.append(
            Problem("fsdp", "hybrid_shard_zero2 is an FSDP1 strategy", "use hybrid_shard (FSDP2 keeps the shards)")
        )

    for key in sorted(set(config) - STOCK_KEYS - HF_EXT_KEYS):
        close = difflib.get_close_matches(key, sorted(STOCK_KEYS | HF_EXT_KEYS), n=1)
        fix = f"did you mean {close[0]!r}?" if close else "remove it (FSDP would ignore it)"
        problems.append(Problem(f"fsdp_config.{key}", "unknown key", fix))

    version = config.get("version", 2)
    if str(version) not in ("1", "2"):
        problems.append(Problem("fsdp_config.version", f"{version!r} is not an FSDP version", "set it to 2"))
    elif int(version) == 1 and not has_accelerator:
        problems.append(FSDP1_ON_CPU)
    if deepspeed:
        problems.append(
            Problem(
                "fsdp",
                "both `fsdp` and `deepspeed` are set: one engine shards the model",
                "pass only one of --fsdp and --deepspeed",
            )
        )

    state_dict_type = config.get("state_dict_type", "auto")
    if state_dict_type == "auto":
        config["state_dict_type"] = DEFAULT_STATE_DICT_TYPE
        changes.append(
            Change(
                "fsdp_config.state_dict_type",
                DEFAULT_STATE_DICT_TYPE,
                "auto: each rank writes its own checkpoint shards",
            )
        )
    elif str(state_dict_type).upper() not in STATE_DICT_TYPES:
        problems.append(
            Problem(
                "fsdp_config.state_dict_type",
                f"{state_dict_type!r} is not a state dict type",
                f"use one of {', '.join(STATE_DICT_TYPES)}",
            )
        )
    if config.get("transformer_layer_cls_to_wrap") == "auto":
        del config["transformer_layer_cls_to_wrap"]  # hf_ext.fsdp.engine.wrap_repeated_layers picks them
        changes.append(
            Change(
                "fsdp_config.transformer_layer_cls_to_wrap",
                "auto",
                "the model's repeated layers, at wrap time",
                "deferred",
            )
        )
    if str(config.get("cpu_offload", False)).lower() == "true" or "offload" in words:
        if not has_accelerator:
            warnings.append(
                "FSDP cpu_offload on a CPU-only host: the parameters already live in RAM; it only adds "
                "copies. Remove it unless the same command also runs on GPUs."
            )

    factor, factor_source = _factor(config.pop("sharding_factor", None), world_size, local_world_size, problems)
    if sharding != "hybrid_shard" and factor_source == "fsdp_config":
        problems.append(
            Problem(
                "fsdp_config.sharding_factor",
                f"only hybrid_shard uses a sharding factor, not {sharding}",
                "use --fsdp hybrid_shard, or remove sharding_factor",
            )
        )
    if problems:
        raise FsdpConfigError(problems, "TrainingArguments")

    if "offload" in words:
        config.setdefault("cpu_offload", True)
    if sharding == "hybrid_shard":
        changes.append(Change("fsdp_config.sharding_factor", factor, factor_source))
        if factor == 1:
            sharding = "no_shard"
        elif factor == world_size:
            sharding = "full_shard"
            warnings.append(f"hybrid_shard with a sharding factor of all {world_size} ranks is full_shard.")
    if sharding == "no_shard":
        # FSDP2 has no un-sharded mode (accelerate refuses a device mesh without a shard dimension): replicating every
        # parameter, gradient and optimizer state on every rank and all-reducing the gradients is DDP.
        changes.append(Change("fsdp", None, "no_shard: every rank holds the whole model, which is DDP", "removed"))
        return FsdpResolution("no_shard", None, {}, 1, world_size, changes, warnings)
    # stock's own spelling: fsdp=True and everything in fsdp_config (fsdp strings are deprecated)
    config.setdefault("reshard_after_forward", sharding != "shard_grad_op")
    if sharding == "hybrid_shard":
        return FsdpResolution("hybrid_shard", True, config, factor, world_size // factor, changes, warnings)
    return FsdpResolution(sharding, True, config, world_size, 1, changes, warnings)


# --- accelerate config files (``accelerate launch --config_file``) -------------------------------------------------

#: accelerate's names for what ``fsdp_config`` of ``TrainingArguments`` calls otherwise
ACCELERATE_RENAMES = {"offload_params": "cpu_offload"}
#: accelerate keys with no ``TrainingArguments`` counterpart (passed to accelerate's plugin, not checked further)
ACCELERATE_ONLY = frozenset({"sharding_strategy", "activation_checkpointing_offload", "ignored_modules"})


def accelerate_fsdp_keys() -> frozenset[str]:
    """The ``fsdp_config`` keys ``accelerate launch`` turns into settings (its own ``--fsdp_*`` options, prefix
    dropped); any other key in a config file is ignored by accelerate without a word."""
    return frozenset(a.dest[5:] for a in launch_command_parser()._actions if a.dest.startswith("fsdp_"))


def _accelerate_key(key: str) -> str:
    """A problem's key as the config file spells it (``fsdp_config.version`` -> ``fsdp_config.fsdp_version``)."""
    if not key.startswith("fsdp_config."):
        return key
    name = key.split(".", 1)[1]
    return "fsdp_config.fsdp_" + next((k for k, v in ACCELERATE_RENAMES.items() if v == name), name)


def resolve_accelerate_config(path: str | Path, *, has_accelerator: bool = False) -> tuple[FsdpResolution, int]:
    """Check the FSDP section of an accelerate config file as :func:`resolve_fsdp` checks ``TrainingArguments``:
    unknown keys (which accelerate ignores), FSDP1 where it cannot run (accelerate's default version when the file
    names none), FSDP1-only keys under FSDP2, and everything :func:`resolve_fsdp` checks. Returns the resolution and
    the number of ranks; raises :class:`FsdpConfigError` with every problem, keys spelled as in the file."""
    try:
        config = load_config_from_file(str(path))
    except (FileNotFoundError, TypeError, ValueError) as err:  # a missing file, or keys accelerate does not take
        raise FsdpConfigError(
            [Problem("config_file", str(err).rstrip("."), "pass an accelerate config file (accelerate config)")],
            str(path),
        ) from err
    problems: list[Problem] = []
    if str(config.distributed_type).split(".")[-1] != "FSDP":
        problems.append(
            Problem("distributed_type", f"{config.distributed_type} is not FSDP", "set distributed_type: FSDP")
        )
    known = accelerate_fsdp_keys()
    raw = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in (config.fsdp_config or {}).items()}
    for key in sorted(set(raw) - known):
        close = difflib.get_close_matches(key, sorted(known), n=1)
        fix = f"did you mean 'fsdp_{close[0]}'?" if close else "remove it"
        problems.append(Problem(f"fsdp_config.fsdp_{key}", "unknown key: accelerate launch ignores it", fix))
    version = raw.get("version", 1)  # accelerate launch's own default
    if str(version) == "2" and "sharding_strategy" in raw:
        problems.append(
            Problem(
                "fsdp_config.fsdp_sharding_strategy",
                "an FSDP1 setting, which FSDP2 ignores",
                "use fsdp_reshard_after_forward: true (full shard) or false (shard_grad_op)",
            )
        )
    reshard = str(raw.get("reshard_after_forward", True)).lower() == "true"
    settings = {ACCELERATE_RENAMES.get(k, k): v for k, v in raw.items() if k in known and k not in ACCELERATE_ONLY}
    settings["version"] = version
    world_size = int(config.num_processes or 1)
    per_node = max(1, world_size // max(1, int(config.num_machines or 1)))
    try:
        resolution = resolve_fsdp(
            "full_shard" if reshard else "shard_grad_op",
            settings,
            world_size=world_size,
            local_world_size=per_node,
            has_accelerator=has_accelerator,
        )
    except FsdpConfigError as err:
        for problem in err.problems:
            if problem == FSDP1_ON_CPU:  # removing the key would not help here: accelerate launch defaults to 1
                fix = "set fsdp_version: 2 (accelerate launch runs FSDP1 when the file names no version)"
                problem = Problem(problem.key, problem.message, fix)
            problems.append(Problem(_accelerate_key(problem.key), problem.message, problem.fix))
    if problems:
        raise FsdpConfigError(problems, str(path))
    return resolution, world_size
