"""TrainingArguments that place a run right on any hardware and under any launcher."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from transformers import Seq2SeqTrainingArguments as _Seq2SeqTrainingArguments
from transformers import TrainingArguments as _TrainingArguments

from .deepspeed_config import DeepSpeedConfigError, Problem, explain_deepspeed_config, launch_world_size
from .ds_loading import accelerate_launch_config
from .memory import return_freed_memory_to_os, wants_freed_memory_released
from .plan_auto import MemoryPlanArguments
from .runtime import has_accelerator, launched_by_deepspeed, place_cpu_threads, release_deepspeed_shm_names

logger = logging.getLogger(__name__)

DEFAULT_LAUNCHER_PRESET = "zero2"


class _HfExtArgsMixin:
    """What stock ``TrainingArguments`` leaves to the user, done before and after its ``__post_init__``:

    * ``deepspeed`` may be a preset name (``zero1``/``zero2``/``zero3``/``zero3_offload``), a JSON path, an
      accelerate YAML or a dict; it is resolved by :func:`hf_ext.explain_deepspeed_config` (every ``"auto"`` that
      does not need the model or the step count filled, spellings normalized, everything validated by DeepSpeed's
      own config models, all mismatches with these arguments raised at once). The record is kept in
      ``hf_ext_deepspeed``;
    * under ``accelerate launch`` with a DeepSpeed YAML and no ``deepspeed`` argument, the YAML's config (its
      ``deepspeed_config_file``, or one built from its inline settings) is resolved the same way;
    * under DeepSpeed's launcher with no ``deepspeed`` config, the ``zero2`` preset is used (the launcher means it);
    * on a host with no accelerator, ``use_cpu`` is switched on — otherwise torchrun / accelerate ranks each believe
      they are alone (world size 1) and DeepSpeed's batch-size assertion fires;
    * CPU ranks get ``cores // local ranks`` threads unless ``OMP_NUM_THREADS`` was set by the user;
    * on CPU, freed memory goes back to the OS at once when the memory planner plans the run or
      ``release_freed_memory`` asks for it (lower peak RSS, some time in page faults).
    """

    def __post_init__(self):
        if not self.deepspeed and (from_accelerate := accelerate_launch_config(os.environ)) is not None:
            logger.info("Using the DeepSpeed config given to `accelerate launch`.")
            self.deepspeed = from_accelerate
            if isinstance(from_accelerate, dict):  # its inline settings are now in the config: accelerate must not
                os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)  # refuse them as conflicting with a config file
        if not self.deepspeed and launched_by_deepspeed():
            logger.info(f"Launched by `deepspeed` without --deepspeed: using the {DEFAULT_LAUNCHER_PRESET!r} preset.")
            self.deepspeed = DEFAULT_LAUNCHER_PRESET
        if not self.use_cpu and not has_accelerator():
            self.use_cpu = True
        if self.deepspeed:
            self._resolve_deepspeed()
        super().__post_init__()
        stock_mismatches = getattr(getattr(self, "hf_deepspeed_config", None), "mismatches", None)
        if stock_mismatches:  # e.g. the launcher's world size differs from the one the distributed state reports
            raise DeepSpeedConfigError([Problem("", m.lstrip("- ")) for m in stock_mismatches], "TrainingArguments")
        if self.deepspeed:
            _start_deepspeed_comm()
        if self.device.type == "cpu":
            place_cpu_threads()
            # hf_ext.memory: ZeRO's temporaries otherwise stay in glibc's heap
            self.hf_ext_released_freed_memory = wants_freed_memory_released(self) and return_freed_memory_to_os()

    def _resolve_deepspeed(self):
        resolution = explain_deepspeed_config(self.deepspeed, self, world_size=launch_world_size(), defer=True)
        for name, value in resolution.args_updates.items():
            logger.info(f"TrainingArguments.{name} = {value!r}, as the DeepSpeed config implies.")
            setattr(self, name, value)
        self.deepspeed = resolution.config
        self.hf_ext_deepspeed = resolution


def _start_deepspeed_comm():
    """Bring up DeepSpeed's comm layer on the process group TrainingArguments just created.

    On CPU (``use_cpu``) accelerate starts torch.distributed but not DeepSpeed's comm; ``zero.Init`` in
    ``from_pretrained`` then believes the world size is 1 and DeepSpeed's batch-size assertion fails.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    import deepspeed
    import deepspeed.comm as ds_comm

    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    release_deepspeed_shm_names()


@dataclass
class TrainingArguments(_HfExtArgsMixin, _TrainingArguments, MemoryPlanArguments):
    __doc__ = _TrainingArguments.__doc__


@dataclass
class Seq2SeqTrainingArguments(_HfExtArgsMixin, _Seq2SeqTrainingArguments, MemoryPlanArguments):
    __doc__ = _Seq2SeqTrainingArguments.__doc__

    generation_min_length: int | None = field(
        default=None,
        metadata={"help": "min_length for generation during evaluation/prediction (default: the model's)."},
    )
    # generation eval (hf_ext.bleu_eval): BLEU/chrF and sample generations at each evaluation
    generation_eval: bool = field(
        default=True,
        metadata={"help": "Generate at each evaluation and log eval_bleu/eval_chrf/eval_gen_len and samples."},
    )
    generation_no_repeat_ngram_size: int | None = field(
        default=None, metadata={"help": "no_repeat_ngram_size for eval generation (default: the model's)."}
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={"help": "Examples per generate() call and rank (default: per_device_eval_batch_size)."},
    )
    generation_bucket_by_length: bool = field(
        default=True,
        metadata={"help": "Sort eval examples into length buckets before generating (output order is kept)."},
    )
    log_samples: int = field(
        default=5,
        metadata={"help": "(context, generation, reference) rows printed and logged at each evaluation."},
    )
