"""hf-ext's TrainingArguments: the stock fields plus every hf-ext setting as a documented field.

``__post_init__`` validates and resolves: the DeepSpeed config, the launcher's implied preset and, when a ZeRO stage,
offload or micro-batch is ``"auto"``, the memory planner's choice (before any model is loaded, since ZeRO-3 changes
how ``from_pretrained`` loads it). The planner's probe builds and runs the model once per process and key (once per
node under a launcher, :func:`hf_ext.memory.auto.measured_once`), with no collective. The resolver only reads the
arguments; the values it implies (``Resolution.args_updates``) are set here. The one other action is the one stock
takes in the same place: starting the distributed layer (on CPU, DeepSpeed's comm beside the process group stock
starts). Threads, malloc tuning and shared-memory housekeeping run once, at train start
(:func:`hf_ext.runtime.prepare_run`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments as _Seq2SeqTrainingArguments
from transformers import TrainingArguments as _TrainingArguments

from .batching import args_layout, layout_of
from .deepspeed.load import accelerate_launch_config
from .deepspeed.resolve import Resolution, explain_deepspeed_config
from .errors import DeepSpeedConfigError, Problem
from .evaluation.settings import GenerationEvalArguments
from .fsdp.config import FsdpResolution, resolve_fsdp
from .packing import PaddingFreeArguments, refuse_split_sequences
from .preemption import PreemptionArguments
from .runtime import (
    has_accelerator,
    launch_world_size,
    launched_by_deepspeed,
    local_world_size,
    start_deepspeed_comm,
)
from .saving.resume import RESUME_GLOBAL_BATCH_POLICIES
from .sizes import DEFAULT_MAX_SHARD_SIZE, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_LAUNCHER_PRESET = "zero2"


@dataclass(kw_only=True)
class TrainingArgumentsMixin(PreemptionArguments):
    """hf-ext's settings, and the resolution of what stock ``TrainingArguments`` leaves to the user, for any
    ``TrainingArguments`` subclass: put it first among the bases of a ``@dataclass``
    (``@dataclass class MyConfig(hf_ext.TrainingArgumentsMixin, SFTConfig)``).

    Before the stock ``__post_init__``:

    * ``deepspeed`` may be a preset name (``zero1``/``zero2``/``zero3``/``zero3_offload``), a JSON path, an
      accelerate YAML or a dict; it is resolved by :func:`hf_ext.explain_deepspeed_config` (every ``"auto"`` that
      does not need the model or the step count filled, spellings normalized, everything validated by DeepSpeed's
      own config models, all mismatches with these arguments raised at once). The record is ``deepspeed_resolution``;
    * under ``accelerate launch`` with a DeepSpeed YAML and no ``deepspeed`` argument, the YAML's config (its
      ``deepspeed_config_file``, or one built from its inline settings) is resolved the same way;
    * under DeepSpeed's launcher with no ``deepspeed`` config, the ``zero2`` preset is used (the launcher means it);
    * on a host with no accelerator, ``use_cpu`` is switched on — otherwise torchrun / accelerate ranks each believe
      they are alone (world size 1) and DeepSpeed's batch-size assertion fires.

    Args:
        memory_per_device (`str`, *optional*):
            Per-rank memory budget for the planner's ``"auto"`` choices, e.g. ``8GB`` or ``7.5GiB``. Default:
            accelerator memory on GPUs, available RAM divided by the ranks on this node on CPU.
        plan_model (`str`, *optional*):
            Model path or hub id the planner probes for activation memory (needed when the DeepSpeed config or the
            batch size is ``"auto"`` and the model is not known yet).
        plan_seq_len (`int`, defaults to 128):
            Tokens per example the memory plan assumes.
        release_freed_memory (`bool`, *optional*):
            On CPU, hand freed memory back to the OS at once: a lower peak resident set for more page faults.
            Default: on when the memory planner plans the run, off otherwise.
        save_max_shard_size (`str`, defaults to ``"5GB"``):
            Largest safetensors shard ``save_model`` writes (``"200MB"``, ``"5GB"``, ``"1GiB"``).
        resume_global_batch (`str`, defaults to ``"keep"``):
            A resume on another number of ranks keeps the checkpoint's global batch by changing the gradient
            accumulation. When this world size and micro-batch cannot make it: ``"keep"`` refuses with the fixes,
            ``"nearest"`` goes on with the nearest global batch these ranks make and says so (the learning rate and
            the schedule are not rescaled).
        save_gather_size (`str`, defaults to ``"256MiB"``):
            Under ZeRO-3, the bound on the extra memory a save needs per rank (with ``save_max_shard_size``: the
            smaller of the two counts). Half of it is gathered at a time, as the collectives stage a second copy.
    """

    memory_per_device: str | None = field(
        default=None,
        metadata={
            "help": "Per-rank memory budget for the planner's auto choices, e.g. 8GB or 7.5GiB (default: "
            "accelerator memory on GPUs, available RAM / ranks on this node on CPU)."
        },
    )
    plan_model: str | None = field(
        default=None,
        metadata={
            "help": "Model path or hub id the planner probes for activation memory (needed when the DeepSpeed "
            "config or the batch size is auto; the recipe passes --model_name_or_path)."
        },
    )
    plan_seq_len: int = field(
        default=128, metadata={"help": "Sequence length (tokens per example) the memory plan assumes."}
    )
    release_freed_memory: bool | None = field(
        default=None,
        metadata={
            "help": "On CPU, hand freed memory back to the OS at once: lower peak RSS, more page faults. "
            "Default: on when the memory planner plans the run, off otherwise."
        },
    )
    save_max_shard_size: str = field(
        default=DEFAULT_MAX_SHARD_SIZE,
        metadata={"help": "Largest safetensors shard written by save_model (e.g. 200MB, 5GB, 1GiB)."},
    )
    save_gather_size: str = field(
        default="256MiB",
        metadata={
            "help": "Under ZeRO-3, the extra memory a save may use per rank (or the shard size if smaller); "
            "half of it is gathered at a time."
        },
    )
    resume_global_batch: str = field(
        default="keep",
        metadata={
            "help": "On a resume on another number of ranks whose micro-batch cannot make the checkpoint's "
            "global batch: keep (refuse, with the fix) or nearest (go on with the nearest global batch these "
            "ranks make, said in the log; nothing is rescaled).",
            "choices": list(RESUME_GLOBAL_BATCH_POLICIES),
        },
    )
    # what resolution found: declared, not passed (init=False keeps them out of to_dict and the command line)
    deepspeed_resolution: Resolution | None = field(default=None, init=False, repr=False)
    fsdp_resolution: FsdpResolution | None = field(default=None, init=False, repr=False)

    @property
    def memory_plan(self):
        """The memory planner's plan of this run (``None`` when it did not plan it)."""
        return self.deepspeed_resolution.memory_plan if self.deepspeed_resolution is not None else None

    def _validate_hf_ext(self) -> None:
        self._validate_preemption()
        deepspeed = self.deepspeed if isinstance(self.deepspeed, dict) else None
        refuse_split_sequences(getattr(self, "padding_free", False), layout_of(1, deepspeed, self.parallelism_config))
        if self.resume_global_batch not in RESUME_GLOBAL_BATCH_POLICIES:
            raise ValueError(
                f"`resume_global_batch`={self.resume_global_batch!r}: use one of "
                f"{', '.join(RESUME_GLOBAL_BATCH_POLICIES)}."
            )
        for name in ("save_max_shard_size", "save_gather_size", "memory_per_device"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                if parse_bytes(value) <= 0:
                    raise ValueError(f"{name} must be positive")
            except ValueError as err:
                raise ValueError(f"`{name}`={value!r}: {err}. Write it like 200MB, 5GB or 8GiB.") from None

    def __post_init__(self):
        self._validate_hf_ext()
        if isinstance(self, GenerationEvalArguments):
            self._validate_generation_eval()
        inline_consumed = False
        if not self.deepspeed and (from_accelerate := accelerate_launch_config(os.environ)) is not None:
            logger.info("Using the DeepSpeed config given to `accelerate launch`.")
            self.deepspeed = from_accelerate
            inline_consumed = isinstance(from_accelerate, dict)  # its inline settings are now in the config
        if self.fsdp:
            self._resolve_fsdp()
        if not self.deepspeed and not self.fsdp and launched_by_deepspeed():
            logger.info(f"Launched by `deepspeed` without --deepspeed: using the {DEFAULT_LAUNCHER_PRESET!r} preset.")
            self.deepspeed = DEFAULT_LAUNCHER_PRESET
        if not self.use_cpu and not has_accelerator():
            self.use_cpu = True
        if self.deepspeed:
            self._resolve_deepspeed()
        with _accelerate_inline_fields_consumed(inline_consumed):
            super().__post_init__()
        stock_mismatches = getattr(getattr(self, "hf_deepspeed_config", None), "mismatches", None)
        if stock_mismatches and args_layout(self).model_parallel > 1:
            # stock's DeepSpeed glue computes train_batch_size over every rank, while DeepSpeed (and stock's own
            # Trainer.get_total_train_batch_size) split it over the data-parallel ranks only, as hf-ext filled it;
            # removed from stock's own list, which deepspeed_init raises on again
            stock_mismatches[:] = [m for m in stock_mismatches if "train_batch_size (calculated)" not in m]
        if stock_mismatches:  # e.g. the launcher's world size differs from the one the distributed state reports
            raise DeepSpeedConfigError([Problem("", m.lstrip("- ")) for m in stock_mismatches], "TrainingArguments")
        if self.deepspeed:
            start_deepspeed_comm()

    def _resolve_fsdp(self):
        resolution = resolve_fsdp(
            self.fsdp,
            self.fsdp_config,
            world_size=launch_world_size(),
            local_world_size=local_world_size(),
            deepspeed=self.deepspeed,
            has_accelerator=has_accelerator(),
        )
        for change in resolution.changes:
            logger.info(f"{change.key} = {change.value!r} ({change.source}).")
        for warning in resolution.warnings:
            logger.warning(warning)
        self.fsdp, self.fsdp_config = resolution.fsdp, (resolution.fsdp_config or None)
        self.fsdp_resolution = resolution

    def _resolve_deepspeed(self):
        given = copy.deepcopy(self.deepspeed)
        resolution = explain_deepspeed_config(self.deepspeed, self, world_size=launch_world_size(), defer=True)
        resolution.given = given
        for name, value in resolution.args_updates.items():
            logger.info(f"TrainingArguments.{name} = {value!r}, as the DeepSpeed config implies.")
            setattr(self, name, value)
        self.deepspeed = resolution.config
        self.deepspeed_resolution = resolution


@contextlib.contextmanager
def _accelerate_inline_fields_consumed(consumed: bool):
    """While stock arguments build the DeepSpeed plugin: hide accelerate's list of inline DeepSpeed fields once hf-ext
    has folded them into the config (accelerate refuses inline fields next to a config). Restored afterwards."""
    saved = os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None) if consumed else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_CONFIG_DS_FIELDS"] = saved


def args_doc(*classes) -> str:
    """The docstring of an arguments class built from ``classes``: the first one's whole, the others' ``Args:``."""
    return (classes[0].__doc__ or "") + "".join((c.__doc__ or "").split("Args:", 1)[-1] for c in classes[1:])


# the preemption fields are the mixin's own: documented with it, wherever it goes (TRL's configs too)
TrainingArgumentsMixin.__doc__ = args_doc(TrainingArgumentsMixin, PreemptionArguments)


@dataclass
class TrainingArguments(TrainingArgumentsMixin, _TrainingArguments, PaddingFreeArguments):
    __doc__ = args_doc(_TrainingArguments, TrainingArgumentsMixin, PaddingFreeArguments)


@dataclass
class Seq2SeqTrainingArguments(
    TrainingArgumentsMixin, _Seq2SeqTrainingArguments, GenerationEvalArguments, PaddingFreeArguments
):
    __doc__ = args_doc(
        _Seq2SeqTrainingArguments, TrainingArgumentsMixin, GenerationEvalArguments, PaddingFreeArguments
    )
