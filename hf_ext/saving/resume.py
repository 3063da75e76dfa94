"""Resuming a DeepSpeed run from any checkpoint, on any number of ranks.

A ZeRO checkpoint holds the optimizer state (and under ZeRO-3 the weights) partitioned over the ranks that wrote it;
DeepSpeed refuses it on another world size ("Automatic adjustment of ZeRO's optimizer state partitioning with a new
world size is not currently supported"). DeepSpeed's *universal* checkpoint holds every parameter's fp32 value and
optimizer state whole, and ``load_universal`` re-partitions it for the ranks that load it. On such a resume hf-ext

* converts the checkpoint with DeepSpeed's own ``ds_to_universal`` (``--inject_missing_state``: transformers'
  checkpoints lack the marker it wants) into ``checkpoint-N.universal`` next to it, once: the conversion is cached
  and the original is never written to;
* keeps the global batch by setting the gradient accumulation (or refuses with the arithmetic and a fix), so that the
  sampler hands every optimizer step the same samples as on the old world size and the schedule's steps match;
* has transformers load the converted directory (it also holds links to the checkpoint's trainer state, RNG and
  scheduler files) with DeepSpeed's own ``checkpoint.load_universal`` switched on in the config the engine starts
  from, and says all of it in one log line.

What a ``train()`` resumes is decided once, by :func:`plan_resume`, on every rank alike (:class:`ResumePlan`); the
trainer then applies the plan (:func:`apply_resume_plan`) and hands ``ResumePlan.load_from`` to stock ``train``.

hf-ext's PEFT checkpoints hold the trainable state by parameter name (:mod:`hf_ext.peft`) and need none of this.
FSDP checkpoints (``SHARDED_STATE_DICT``) are resharded by torch.distributed.checkpoint as they load; there only the
global batch is kept, from the world size and batch hf-ext's checkpoint marker records.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers.trainer as hf_trainer
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

from ..atomic import replace_dir
from ..batching import Layout, args_layout, split_batch
from ..peft import is_trainable_state_checkpoint
from ..ranks import shared_outcome
from ..sizes import MiB, dir_bytes
from . import checkpoints
from .checkpoints import CHECKPOINT_MARKER, TMP_PREFIX, UNIVERSAL_SUFFIX
from .model_dir import DEEPSPEED_TAG_FILE

logger = logging.getLogger(__name__)

UNIVERSAL_MARKER = "hf_ext_universal.json"
LATEST_UNIVERSAL = "latest_universal"  # the tag file DeepSpeed's load_universal reads instead of DEEPSPEED_TAG_FILE
FSDP_MODEL_DIR = f"{FSDP_MODEL_NAME}_0"  # the DCP folders accelerate's save_fsdp_model / save_fsdp_optimizer write
FSDP_OPTIMIZER_DIR = f"{OPTIMIZER_NAME}_0"


def engine_of(path: Path) -> str | None:
    """``"deepspeed"``, ``"fsdp2"`` or ``None``: which engine's state the checkpoint ``path`` holds."""
    if (path / DEEPSPEED_TAG_FILE).is_file() or (path / LATEST_UNIVERSAL).is_file():
        return "deepspeed"
    if (path / FSDP_MODEL_DIR).is_dir():
        return "fsdp2"
    return None


@dataclass(frozen=True)
class ZeroCheckpoint:
    """What a checkpoint directory says about the run that wrote it: DeepSpeed's partitioned state, or (FSDP) the
    marker hf-ext writes into every complete checkpoint."""

    path: Path  # checkpoint-N
    tag: str  # global_stepN (DeepSpeed), "" (FSDP)
    world_size: int  # ranks that wrote each tensor-parallel slice of the partitioned state (DeepSpeed's dp_world_size)
    train_batch_size: int | None  # DeepSpeed's: it counts each tensor-parallel rank (Layout.deepspeed_ranks)
    micro_batch: int | None
    accumulation: int | None
    tensor_parallel: int = 1  # DeepSpeed's mp_world_size: AutoTP's size

    @property
    def universal_path(self) -> Path:
        return self.path.with_name(self.path.name + UNIVERSAL_SUFFIX)

    @property
    def rows_per_step(self) -> int | None:
        """The rows one optimizer step trained on: the ranks of a tensor-parallel group share their micro-batches."""
        return self.train_batch_size // self.tensor_parallel if isinstance(self.train_batch_size, int) else None

    def same_layout(self, layout: Layout) -> bool:
        """True when a run of ``layout`` holds the partitioned state as written: the same tensor-parallel size, and
        as many ranks per slice (DeepSpeed records the sequence-parallel ranks among them)."""
        return self.tensor_parallel == layout.tp and self.world_size == layout.world // layout.tp

    def writers(self) -> str:
        """The ranks that wrote it: ``2 ranks``, or under AutoTP ``2 ranks, tensor-parallel 2``."""
        total = _ranks(self.world_size * self.tensor_parallel)
        return total if self.tensor_parallel == 1 else f"{total}, tensor-parallel {self.tensor_parallel}"

    def batch_arithmetic(self) -> str:
        ranks = (
            _ranks(self.world_size)
            if self.tensor_parallel == 1
            else (
                f"{self.world_size} data-parallel {'rank' if self.world_size == 1 else 'ranks'} (tensor-parallel "
                f"{self.tensor_parallel})"
            )
        )
        return f"{ranks} x micro-batch {self.micro_batch} x accumulation {self.accumulation} = {self.rows_per_step}"


def read_zero_checkpoint(path: str | Path) -> ZeroCheckpoint | None:
    """The ZeRO checkpoint in ``path`` (its ``latest`` tag), or ``None`` when there is no partitioned state there."""
    path = Path(path)
    latest = path / DEEPSPEED_TAG_FILE
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    folder = path / tag
    optim_files = sorted(folder.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    model_files = sorted(folder.glob("*mp_rank_00_model_states.pt"))
    if not optim_files or not model_files:
        return None  # no ZeRO partitioning: any world size loads it
    # mmap: under ZeRO-1/2 this file also holds the whole model, which is not read here. Under ZeRO, DeepSpeed's
    # engine (_save_checkpoint) pickles into it dicts, lists, OrderedDicts, torch.Size, tensors, numbers and strings
    # only (the optimizer's own classes go into the *_optim_states.pt files): torch's weights-only defaults suffice.
    states = torch.load(model_files[0], map_location="cpu", mmap=True, weights_only=True)
    config = states.get("ds_config") or {}
    return ZeroCheckpoint(
        path=path,
        tag=tag,
        world_size=int(states.get("dp_world_size") or len(optim_files)),
        train_batch_size=config.get("train_batch_size"),
        micro_batch=config.get("train_micro_batch_size_per_gpu"),
        accumulation=config.get("gradient_accumulation_steps"),
        tensor_parallel=int(states.get("mp_world_size") or 1),
    )


def _fingerprint(folder: Path) -> dict[str, list[int]]:
    """Size and mtime of each file of the source tag: a re-written checkpoint invalidates its conversion."""
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(folder.iterdir()) if p.is_file()}


def cached_universal(checkpoint: ZeroCheckpoint) -> Path | None:
    """The conversion of ``checkpoint`` made earlier, if it is complete and of the checkpoint as it is now."""
    out = checkpoint.universal_path
    try:
        marker = json.loads((out / UNIVERSAL_MARKER).read_text())
    except (OSError, ValueError):
        return None
    same = marker.get("tag") == checkpoint.tag and marker.get("source") == _fingerprint(
        checkpoint.path / checkpoint.tag
    )
    return out if same and marker.get("trainer_files") == _trainer_files(checkpoint.path) else None


def _trainer_files(checkpoint: Path) -> list[str]:
    """The files beside the DeepSpeed state that ``train`` reads on a resume (trainer state, RNG, scheduler, scaler,
    weights), linked into the conversion so that it is a checkpoint transformers resumes from as it is."""
    return sorted(
        p.name for p in checkpoint.iterdir() if p.is_file() and p.name not in (DEEPSPEED_TAG_FILE, CHECKPOINT_MARKER)
    )


def _ds_to_universal_input(tag_folder: Path, scratch: Path) -> Path:
    """``tag_folder``, or a copy of it in ``scratch`` when its model states record another tensor-parallel size than
    the one that wrote them. DeepSpeed 0.19 records ``tp_degree`` from its model-parallel unit's size, and the unit a
    Ulysses run hands it answers with the sequence-parallel size (the aliasing deepspeedai/DeepSpeed#8226 undid for
    the rank that picks a model-state file), beside ``mp_world_size`` 1: the weights are whole on every rank.
    ``ds_to_universal`` then counts the model-state files against that size and refuses the checkpoint. The copy
    holds hard links to the files, and the model states rewritten with ``tp_degree`` = ``mp_world_size``."""
    from deepspeed.checkpoint.constants import (  # noqa: PLC0415 (DeepSpeed: a conversion only)
        CHECKPOINT_PARALLEL_DIMS,
        CHECKPOINT_PP_DEGREE,
        CHECKPOINT_TP_DEGREE,
        MODEL_FILE_PREFIX,
    )

    files = sorted(p for p in tag_folder.iterdir() if p.name.startswith(MODEL_FILE_PREFIX))
    try:  # tensors and plain containers only; a file holding more is left to DeepSpeed as it is
        states = [torch.load(p, map_location="cpu", mmap=True, weights_only=True) for p in files]
    except pickle.UnpicklingError:
        return tag_folder
    first = states[0] if states else {}
    dims, written = first.get(CHECKPOINT_PARALLEL_DIMS), first.get("mp_world_size")
    if not isinstance(dims, dict) or not isinstance(written, int) or dims.get(CHECKPOINT_TP_DEGREE) == written:
        return tag_folder
    if dims.get(CHECKPOINT_PP_DEGREE, 1) * written != len(files):
        return tag_folder
    scratch.mkdir(parents=True)
    for path in tag_folder.iterdir():
        if path.is_file() and path not in files:
            os.link(path, scratch / path.name)
    for path, state in zip(files, states):
        torch.save({**state, CHECKPOINT_PARALLEL_DIMS: {**dims, CHECKPOINT_TP_DEGREE: written}}, scratch / path.name)
    return scratch


def run_ds_to_universal(tag_folder: Path, output_folder: Path) -> float:
    """DeepSpeed's own ``ds_to_universal`` of one checkpoint tag (``global_stepN``) into ``output_folder``; returns
    the seconds it took. ``RuntimeError`` with DeepSpeed's last line when it fails (``output_folder`` removed). A
    Ulysses run's checkpoint is converted from a copy that records the tensor-parallel size that wrote it
    (:func:`_ds_to_universal_input`)."""
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    scratch = output_folder.with_name(f"{output_folder.name}.input")
    shutil.rmtree(scratch, ignore_errors=True)
    start = time.perf_counter()
    source = _ds_to_universal_input(tag_folder, scratch)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(source),
        "--output_folder",
        str(output_folder),
        "--inject_missing_state",
        "--num_extract_workers",
        workers,
        "--num_merge_workers",
        workers,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        shutil.rmtree(output_folder, ignore_errors=True)
        lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        raise RuntimeError(
            f"DeepSpeed's ds_to_universal could not convert {tag_folder}: "
            f"{lines[-1] if lines else f'exit code {proc.returncode}'}"
        )
    return time.perf_counter() - start


def convert_to_universal(checkpoint: ZeroCheckpoint) -> tuple[Path, float]:
    """Convert ``checkpoint`` with DeepSpeed's ``ds_to_universal`` into ``checkpoint-N.universal`` (written as
    ``tmp-checkpoint-N.universal`` and renamed when complete). Returns the path and the seconds it took."""
    out = checkpoint.universal_path
    tmp = out.with_name(TMP_PREFIX + out.name)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        seconds = run_ds_to_universal(checkpoint.path / checkpoint.tag, tmp / checkpoint.tag)
    except RuntimeError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"{err} (for a resume on another number of ranks). Resume it with the world size that "
            f"wrote it ({checkpoint.world_size})."
        ) from None
    (tmp / LATEST_UNIVERSAL).write_text(checkpoint.tag)
    files = _trainer_files(checkpoint.path)
    for name in files:  # hard links: the checkpoint's own bytes, never a second copy (the same directory)
        os.link(checkpoint.path / name, tmp / name)
    marker = {
        "tag": checkpoint.tag,
        "world_size": checkpoint.world_size,
        "seconds": round(seconds, 2),
        "source": _fingerprint(checkpoint.path / checkpoint.tag),
        "trainer_files": files,
    }
    (tmp / UNIVERSAL_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    replace_dir(tmp, out)
    return out, seconds


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _filled_from_args(resolution, key: str) -> bool:
    """True when hf-ext filled ``key`` of the DeepSpeed config from the TrainingArguments (it was ``"auto"``)."""
    return any(c.key == key and c.action in ("filled", "added") for c in resolution.changes)


#: what a resume does when this world size and micro-batch cannot make the checkpoint's global batch
RESUME_GLOBAL_BATCH_POLICIES = ("keep", "nearest")


def nearest_accumulation(total: int, world: int, micro: int) -> int:
    """The gradient accumulation whose global batch on ``world`` ranks of ``micro`` rows is nearest ``total`` (the
    smaller one on a tie)."""
    low = max(1, total // (world * micro))
    return min((low, low + 1), key=lambda a: (abs(world * micro * a - total), a))


def global_batch(args, checkpoint: ZeroCheckpoint) -> tuple[int | None, str]:
    """The gradient accumulation that makes this run's global batch the checkpoint's (``None``: as asked), and a
    phrase for the log line. The global batch is the rows of one optimizer step: the data-parallel ranks' micro-batches
    (the ranks of a tensor- or sequence-parallel group share theirs). The per-rank batch is left as asked. When the
    checkpoint's global batch cannot be made on this world size with that micro-batch: with
    ``resume_global_batch="nearest"`` the accumulation of the nearest global batch (the phrase says what changes);
    otherwise ``ValueError`` with the arithmetic and the fixes."""
    layout = args_layout(args)
    world, micro, accum = layout.dp, args.per_device_train_batch_size, args.gradient_accumulation_steps
    ranks = layout.ranks()
    total = checkpoint.rows_per_step
    if not isinstance(total, int) or world * micro * accum == total:
        return None, f"global batch {world * micro * accum} as before"
    if total % (world * micro) == 0:
        new_accum = total // (world * micro)
        return new_accum, f"gradient accumulation {accum} -> {new_accum} keeps the global batch of {total}"
    nearest = nearest_accumulation(total, world, micro)
    if getattr(args, "resume_global_batch", "keep") == "nearest":
        return nearest, (
            f"resume_global_batch='nearest': the global batch changes {total} -> {world * micro * nearest} "
            f"({ranks} x micro-batch {micro} x accumulation {nearest}; {checkpoint.path.name} was trained with "
            f"{checkpoint.batch_arithmetic()}). The learning rate and the schedule are not rescaled, and the resumed "
            f"epoch skips the rows of the steps done counted in batches of {world * micro * nearest}"
        )
    if total % world:
        divisors = [str(d) for d in range(1, total + 1) if total % d == 0]
        kind = "ranks" if layout.model_parallel == 1 else "data-parallel ranks"
        fix = f"resume on a number of {kind} that divides {total} ({', '.join(divisors)})"
    else:
        new_micro, new_accum = split_batch(total, world, micro)
        fix = (
            f"pass --per_device_train_batch_size {new_micro} --gradient_accumulation_steps {new_accum} "
            f"({world} x {new_micro} x {new_accum} = {total})"
        )
    raise ValueError(
        f"{checkpoint.path.name} was trained with a global batch of {total} ({checkpoint.batch_arithmetic()}); "
        f"{ranks} x micro-batch {micro} cannot make {total} with any gradient accumulation. Fix: {fix}; or "
        f"pass --resume_global_batch nearest to go on with the nearest global batch these ranks make "
        f"({world * micro * nearest})."
    )


def _engine_configs(trainer) -> list[dict]:
    """The DeepSpeed config dicts the engine will start from (the arguments' and the accelerator plugin's)."""
    args = trainer.args
    plugin = getattr(getattr(trainer.accelerator, "state", None), "deepspeed_plugin", None)
    configs = {
        id(c): c
        for c in (
            getattr(getattr(args, "hf_deepspeed_config", None), "config", None),
            getattr(getattr(plugin, "hf_ds_config", None), "config", None),
        )
        if c is not None
    }
    return list(configs.values())


def _set_accumulation(trainer, accumulation: int) -> None:
    """``gradient_accumulation_steps`` (and the global batch it makes) in the arguments and in the DeepSpeed config
    the engine will start from."""
    args = trainer.args
    layout = args_layout(args)
    total = layout.deepspeed_ranks * args.per_device_train_batch_size * accumulation
    resolution = getattr(args, "deepspeed_resolution", None)
    wanted = {"gradient_accumulation_steps": accumulation, "train_batch_size": total}
    for config in _engine_configs(trainer):
        for key, value in wanted.items():
            if config.get(key, value) == value:
                continue
            if resolution is not None and not _filled_from_args(resolution, key):
                raise ValueError(
                    f"The DeepSpeed config fixes {key} to {config[key]}, but a global batch of {total} on "
                    f'{layout.ranks(deepspeed=True)} needs {value}. Fix: set {key} to "auto" in the config.'
                )
            config[key] = value
    args.gradient_accumulation_steps = accumulation


def read_marked_checkpoint(path: str | Path) -> ZeroCheckpoint | None:
    """The world size and batch a complete hf-ext checkpoint was written with (its marker), or ``None`` for a
    checkpoint without them (another writer, or an older hf-ext)."""
    try:
        info = json.loads((Path(path) / CHECKPOINT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    world, micro, accum = (info.get(k) for k in ("world_size", "micro_batch", "accumulation"))
    if not all(isinstance(v, int) for v in (world, micro, accum)):
        return None
    return ZeroCheckpoint(Path(path), "", world, world * micro * accum, micro, accum)


#: what a ``train()`` resumes: nothing; a checkpoint loaded as written (same world size, or no partitioned state);
#: hf-ext's PEFT trainable state (by name, any world size); FSDP shards resharded as they load; a ZeRO checkpoint of
#: another world size, loaded from its universal conversion
RESUME_KINDS = ("fresh", "as_written", "peft", "fsdp_reshard", "universal")


@dataclass(frozen=True)
class ResumePlan:
    """What ``train()`` resumes, decided once before the engine starts (:func:`plan_resume`)."""

    kind: str = "fresh"
    checkpoint: Path | None = None  # the checkpoint resumed (``resume_from_checkpoint=True``: the newest complete)
    load_from: Path | None = None  # what stock ``train`` loads: the checkpoint, or its universal conversion
    written_on: ZeroCheckpoint | None = None  # the world size and batch of a checkpoint of another world size
    accumulation: int | None = None  # the gradient accumulation that keeps its global batch (None: as asked)
    batch: str = ""  # what happens to the global batch, for the log line
    took: str = ""  # the universal conversion: done now (seconds) or earlier

    def __post_init__(self):
        assert self.kind in RESUME_KINDS, self.kind

    @property
    def resume_from_checkpoint(self) -> str | None:
        return None if self.load_from is None else str(self.load_from)


def refuse_other_engine(path: Path, engine: str) -> None:
    """``ValueError`` with the ``hf-ext convert`` command when ``path`` holds the other engine's optimizer state."""
    written = engine_of(path)
    if written is not None and written != engine:
        raise ValueError(
            f"{path} is a {written} checkpoint and this run trains with {engine}: convert it first, "
            f"hf-ext convert {path} {path}-{engine} --to {engine}, and resume from {path}-{engine}."
        )


def plan_resume(trainer, resume_from_checkpoint) -> ResumePlan:
    """Decide what ``train(resume_from_checkpoint)`` resumes; every rank calls it and gets the same plan (a failure
    on any rank raises on all). On the saving process: leftovers of interrupted writes are removed first, and a
    checkpoint of another world size is converted (once: the conversion is cached beside it)."""
    args = trainer.args
    with shared_outcome(f"finding the checkpoint to resume from in {args.output_dir}"):
        found = checkpoints.resolve_resume_from_checkpoint(trainer, resume_from_checkpoint)
        if args.should_save:
            checkpoints.remove_leftovers(args.output_dir)
    if found is None or isinstance(found, bool):
        return ResumePlan()
    path = Path(found)
    with shared_outcome(f"reading {path} to resume from"):  # each rank reads it on its own
        if is_trainable_state_checkpoint(path):  # the trainable state by name, for any world size
            written = read_marked_checkpoint(path)
            if written is None or written.world_size == args.world_size:
                return ResumePlan("peft", path, path)
            return ResumePlan("peft", path, path, written, *global_batch(args, written))
        fsdp = getattr(trainer, "is_fsdp_enabled", False)
        deepspeed = getattr(trainer, "is_deepspeed_enabled", False)
        if not fsdp and not deepspeed:
            return ResumePlan("as_written", path, path)
        refuse_other_engine(path, "fsdp2" if fsdp else "deepspeed")
        if deepspeed and (path / LATEST_UNIVERSAL).is_file() and not (path / DEEPSPEED_TAG_FILE).is_file():
            written = read_marked_checkpoint(path)  # `hf-ext convert --to deepspeed` wrote it: universal only
            if written is None:
                raise ValueError(
                    f"{path} holds a universal checkpoint without hf-ext's marker: resume it as DeepSpeed "
                    "documents (checkpoint.load_universal in the config)."
                )
            accumulation, batch = global_batch(args, written)
            return ResumePlan("universal", path, path, written, accumulation, batch, "converted by hf-ext convert")
        written = read_marked_checkpoint(path) if fsdp else read_zero_checkpoint(path)
        if written is None or written.same_layout(args_layout(args)):
            return ResumePlan("as_written", path, path)
        accumulation, batch = global_batch(args, written)
    if fsdp:  # torch.distributed.checkpoint reshards the model and optimizer state as they load
        return ResumePlan("fsdp_reshard", path, path, written, accumulation, batch)
    took = "converted earlier"
    with shared_outcome(f"converting {path} to a universal checkpoint"):
        if cached_universal(written) is None and args.should_save:
            _, seconds = convert_to_universal(written)
            took = f"converted in {seconds:.1f} s"
    universal = cached_universal(written)
    if universal is None:
        raise RuntimeError(
            f"The universal conversion of {path} is not there for this process: it failed on the saving process, "
            f"or {path.parent} is not shared by every node. Put the run directory on a filesystem every node "
            f"sees, or resume with the world size that wrote it ({written.world_size})."
        )
    return ResumePlan("universal", path, universal, written, accumulation, batch, took)


def apply_resume_plan(trainer, plan: ResumePlan) -> None:
    """Before the engine starts: the gradient accumulation that keeps the checkpoint's global batch, and DeepSpeed's
    ``checkpoint.load_universal`` for a universal conversion, in the arguments and the configs the engine starts
    from; one log line for a resume on another world size."""
    args = trainer.args
    if plan.accumulation is not None:
        _set_accumulation(trainer, plan.accumulation)
        rows = args_layout(args).dp * args.per_device_train_batch_size * plan.accumulation
        if rows != plan.written_on.rows_per_step:
            if args.should_log:  # resume_global_batch="nearest": said whatever the resume's kind
                logger.warning(f"Resuming {plan.checkpoint.name}: {plan.batch}.")
    if plan.kind == "universal":
        for config in _engine_configs(trainer):
            config.setdefault("checkpoint", {})["load_universal"] = True
        if args.should_log:
            size = dir_bytes(plan.load_from) / MiB
            logger.warning(
                f"Resuming {plan.checkpoint.name} (written on {plan.written_on.writers()}) on "
                f"{args.world_size}: loaded from the DeepSpeed universal checkpoint {plan.load_from.name} "
                f"({plan.took}, {size:.0f} MiB); {plan.batch}."
            )
    elif plan.kind == "peft" and plan.written_on is not None and args.should_save:
        logger.info(
            f"Resuming {plan.checkpoint.name} (trainable state by name, written on "
            f"{plan.written_on.writers()}) on {args.world_size}: {plan.batch}."
        )
    elif plan.kind == "fsdp_reshard" and args.should_save:
        logger.info(
            f"Resuming {plan.checkpoint.name} (written on {plan.written_on.writers()}) on "
            f"{args.world_size}: the FSDP shards are resharded as they load; {plan.batch}."
        )


@contextmanager
def peft_state_under_deepspeed(trainer, plan: ResumePlan):
    """While ``trainer.train`` runs a PEFT resume under DeepSpeed: skip transformers' DeepSpeed load
    (``deepspeed_load_checkpoint``, a module global of ``transformers.trainer`` with no public hook; it raises on a
    directory without DeepSpeed's partitioned state). :func:`hf_ext.peft.load_trainable_state` loads the state right
    after it, from ``Trainer._load_optimizer_and_scheduler``."""
    if plan.kind != "peft" or not getattr(trainer, "is_deepspeed_enabled", False):
        yield
        return
    original = hf_trainer.deepspeed_load_checkpoint

    def load(engine, path, *args, **kwargs):
        return None if Path(path) == plan.load_from else original(engine, path, *args, **kwargs)

    hf_trainer.deepspeed_load_checkpoint = load
    try:
        yield
    finally:
        hf_trainer.deepspeed_load_checkpoint = original
