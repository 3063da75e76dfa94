"""Crash-safe Trainer checkpoints: written into ``tmp-checkpoint-N``, renamed to ``checkpoint-N`` once every rank is
done; rotation and ``resume_from_checkpoint=True`` only ever see complete checkpoints."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy

from .. import atomic
from ..peft import is_peft_model, save_trainable_state
from ..ranks import shared_outcome

logger = logging.getLogger(__name__)

CHECKPOINT_MARKER = "hf_ext_checkpoint.json"
CHECKPOINT_PREFIX = "checkpoint"
TMP_PREFIX = "tmp-"
UNIVERSAL_SUFFIX = ".universal"  # checkpoint-N.universal: its DeepSpeed universal conversion (hf_ext.saving.resume)
TRAINER_STATE_NAME = "trainer_state.json"
_RE_CHECKPOINT = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")
_RE_TMP = re.compile(rf"^{TMP_PREFIX}{CHECKPOINT_PREFIX}-(\d+)(\{UNIVERSAL_SUFFIX})?$")


def is_complete_checkpoint(path: str | Path) -> bool:
    """A checkpoint is complete when hf-ext marked it so, or (written by stock code) it holds its trainer state."""
    path = Path(path)
    return (path / CHECKPOINT_MARKER).is_file() or (path / TRAINER_STATE_NAME).is_file()


def checkpoint_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``checkpoint-N`` directory, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir() and (m := _RE_CHECKPOINT.match(p.name))]
    return sorted(found)


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Interrupted saves: ``tmp-checkpoint-N`` leftovers and ``checkpoint-N`` directories that are not complete."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    tmp = [p for p in run_dir.iterdir() if p.is_dir() and _RE_TMP.match(p.name)]
    return sorted(tmp) + [p for _, p in checkpoint_dirs(run_dir) if not is_complete_checkpoint(p)]


def last_complete_checkpoint(run_dir: str | Path, warn: bool = True) -> str | None:
    """The newest complete ``checkpoint-N`` in ``run_dir``; incomplete ones are skipped with a warning."""
    if warn:
        for path in incomplete_checkpoints(run_dir):
            logger.warning(f"Skipping the incomplete checkpoint {path} (a save was interrupted); it is not resumed.")
    complete = [p for _, p in checkpoint_dirs(run_dir) if is_complete_checkpoint(p)]
    return str(complete[-1]) if complete else None


def rotate_complete_checkpoints(run_dir: str | Path, save_total_limit: int | None, best: str | None = None) -> None:
    """Keep at most ``save_total_limit`` complete checkpoints; the newest complete one and ``best`` are never deleted.

    Incomplete ones do not count and are left alone (the next save of the same step replaces a leftover).
    """
    if not save_total_limit or save_total_limit <= 0:
        return
    complete = [p for _, p in checkpoint_dirs(run_dir) if is_complete_checkpoint(p)]
    if len(complete) <= save_total_limit:
        return
    protected = {complete[-1].resolve()}
    if best:
        protected.add(Path(best).resolve())
    keep = max(save_total_limit, len(protected))
    remaining = len(complete)
    for path in complete:
        if remaining <= keep:
            break
        if path.resolve() in protected:
            continue
        logger.info(f"Deleting older checkpoint {path} due to save_total_limit={save_total_limit}")
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(path.with_name(path.name + UNIVERSAL_SUFFIX), ignore_errors=True)  # its cached conversion
        remaining -= 1


def write_marker(path: str | Path, **info) -> None:
    Path(path, CHECKPOINT_MARKER).write_text(json.dumps({"complete": True, **info}, indent=2) + "\n")


def remove_leftovers(run_dir: str | Path) -> None:
    """Remove what interrupted writes left in and beside ``run_dir`` (main process, before a run writes anything):
    a staged or set-aside final save (:func:`hf_ext.atomic.recover`), ``tmp-checkpoint-N`` (and its universal
    conversion's) directories, and a ``checkpoint-N`` swap cut between its two renames (finished or undone)."""
    run_dir = Path(run_dir)
    atomic.recover(run_dir)
    if not run_dir.is_dir():
        return
    for path in sorted(run_dir.iterdir()):
        if not path.is_dir():
            continue
        if _RE_TMP.match(path.name):
            final = path.with_name(path.name[len(TMP_PREFIX) :])
            if not final.exists() and atomic.old_path(final).exists() and is_complete_checkpoint(path):
                os.replace(path, final)  # the swap was cut after the old one went aside: finish it
                continue
            logger.warning(f"Removing {path}, left by an interrupted save.")
            shutil.rmtree(path)
    for path in sorted(run_dir.glob(f".*{atomic.OLD_SUFFIX}")):
        final = path.with_name(path.name[1 : -len(atomic.OLD_SUFFIX)])
        if not final.exists():
            os.replace(path, final)  # the swap was cut and no complete new content was there: the old one stays
        else:
            shutil.rmtree(path)


# ----------------------------------------------------------------------------------------------------------------
# the Trainer's side
# ----------------------------------------------------------------------------------------------------------------


def resume_word(resume_from_checkpoint) -> str | None:
    """``"true"`` or ``"last"`` when ``resume_from_checkpoint`` asks for the newest checkpoint (``True``, or one of
    those words as a command line gives them, unless a directory has that name); ``None`` for a path or nothing."""
    if resume_from_checkpoint is True:
        return "true"
    word = resume_from_checkpoint.strip().lower() if isinstance(resume_from_checkpoint, str) else None
    return word if word in ("true", "last") and not Path(resume_from_checkpoint).exists() else None


def resolve_resume_from_checkpoint(trainer, resume_from_checkpoint):
    """``True`` → the newest complete checkpoint of ``output_dir`` (incomplete ones skipped with a warning); the
    string ``"true"`` (any case, what ``--resume_from_checkpoint True`` gives a script) means the same. ``"last"``:
    the newest complete checkpoint if there is one, else a fresh start (as Lightning's ``ckpt_path="last"``), for a
    command that a requeued job or an elastic restart runs again unchanged. A directory of either name is a path."""
    word = resume_word(resume_from_checkpoint)
    if word is None:
        return resume_from_checkpoint
    found = last_complete_checkpoint(trainer.args.output_dir, warn=trainer.is_world_process_zero())
    if found is None and word == "last":
        if trainer.is_world_process_zero():
            logger.info(
                f"resume_from_checkpoint='last': no checkpoint in {trainer.args.output_dir} yet, training "
                "from the start."
            )
        return None
    if found is None:
        raise ValueError(f"No valid checkpoint found in output directory ({trainer.args.output_dir})")
    return found


def save_checkpoint_atomically(trainer, model, trial=None) -> str:
    """What ``Trainer._save_checkpoint`` does — model, optimizer/scheduler, scaler, RNG and trainer state, push,
    rotation — but written into ``tmp-checkpoint-N`` and renamed to ``checkpoint-N`` only once every rank is done.

    A crash (even ``kill -9`` of one rank) at any point leaves the previous checkpoints as they were; the leftover
    ``tmp-`` directory is never resumed from, never counted by rotation, and replaced by the next save of its step.
    """
    args, state = trainer.args, trainer.state
    folder = f"{CHECKPOINT_PREFIX}-{state.global_step}"
    if trainer.hp_search_backend is None and trial is None:
        trainer.store_flos()
    run_dir = Path(trainer._get_output_dir(trial=trial))
    final, tmp = run_dir / folder, run_dir / f"{TMP_PREFIX}{folder}"
    with shared_outcome(f"preparing {tmp}"):
        if args.should_save:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)

    trainer.save_model(str(tmp), _internal_call=True)
    best_step = state.best_global_step
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and best_step:
        trainer.accelerator.wait_for_everyone()
        best_dir = run_dir / f"{CHECKPOINT_PREFIX}-{best_step}"
        if best_step == state.global_step or best_dir.exists():
            state.best_model_checkpoint = str(best_dir)
    # each rank writes its own part (optimizer partition, RNG state); the main rank the trainer state
    with shared_outcome(f"writing {tmp}"):
        if not args.save_only_model:
            if is_peft_model(trainer.model):  # world-size-independent, adapter-sized: no ZeRO checkpoint
                save_trainable_state(trainer, tmp)
            else:
                trainer._save_optimizer_and_scheduler(str(tmp))
                trainer._save_scaler(str(tmp))
            trainer._save_rng_state(str(tmp))
        if args.should_save:
            exportable = [
                cb for cb in trainer.callback_handler.callbacks + [trainer.control] if isinstance(cb, ExportableState)
            ]
            for cb in exportable:
                name = cb.__class__.__name__
                if isinstance(state.stateful_callbacks[name], list):
                    state.stateful_callbacks[name].append(cb.state())
                else:
                    state.stateful_callbacks[name] = cb.state()
            state.save_to_json(str(tmp / TRAINER_STATE_NAME))

    with shared_outcome(f"renaming {tmp} to {final.name}"):  # every rank has written its part
        if args.should_save:
            write_marker(
                tmp,
                global_step=state.global_step,
                world_size=args.world_size,
                micro_batch=args.per_device_train_batch_size,
                accumulation=args.gradient_accumulation_steps,
            )
            atomic.replace_dir(tmp, final)  # fsynced first
    if args.push_to_hub:
        trainer._push_from_checkpoint(str(final))
    with shared_outcome(f"rotating the checkpoints of {run_dir}"):
        if args.should_save:
            rotate_complete_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint)
    return str(final)
