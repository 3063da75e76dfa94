"""What a run the app started and the app tell each other through the environment: the training's progress as JSON
lines, and the run's niceness. The training writes (:class:`ProgressFile`, :func:`phase`, :func:`phase_rows`,
:func:`join_run_niceness`); the operator's page reads (:func:`read_progress`, :mod:`chat_e.studio.runs`).

The progress: a training's progress as JSON lines, for whoever watches it from another process.

``CHAT_E_PROGRESS_FILE`` names the file (the environment reaches every rank under any launcher); rank 0 appends one
line per event: ``{"event": "begin", ...}``, then ``{"event": "log", ...}`` with what the Trainer logged (loss,
learning rate; DPO's ``rewards/margins`` and ``rewards/accuracies``), then ``{"event": "end", ...}``, each with
``step``, ``max_steps`` and ``time``; and ``{"event": "phase", "phase": ..., "time": ...}`` as the run enters each
part outside the training loop (:data:`PHASES`; the rows' split comes with the evaluation before). Each line is
written whole with one ``write``; a reader skips a last line cut short by a kill.

The niceness: ``CHAT_E_RUN_NICENESS`` is the nice value the app gives a run (the launcher starts niced; its ranks
inherit it). Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, on in many kernels) first
divides the CPU between sessions, and a nice value counts only within its session. A run has a session of its own (it
outlives a restarted server) and torchrun and DeepSpeed's launcher start each rank in another, so each rank gives its
session's group the same niceness (:func:`set_session_niceness`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from transformers import TrainerCallback

ENV = "CHAT_E_PROGRESS_FILE"
#: a run's parts, in order: the training loop is TRAINING (its steps are the "begin" and "log" events)
PREPARING, EVAL_BEFORE, TRAINING, EVAL_AFTER, SAVING = (
    "preparing the data and the model", "evaluating before training", "training", "evaluating after training",
    "saving the model",
)  # fmt: skip
PHASES = (PREPARING, EVAL_BEFORE, TRAINING, EVAL_AFTER, SAVING)
NICENESS_ENV = "CHAT_E_RUN_NICENESS"
#: this process's session's scheduling group and its nice value (Linux)
AUTOGROUP = Path("/proc/self/autogroup")


def set_session_niceness(niceness: int) -> bool:
    """Give this process's session's scheduling group the nice value ``niceness`` (raising it needs no privilege);
    False where the kernel has no such group."""
    try:
        AUTOGROUP.write_text(f"{int(niceness)}\n")
    except OSError:
        return False
    return True


def read_progress(path: str | Path) -> list[dict]:
    """The records of a progress file, oldest first (none when it does not exist yet; a partial line skipped)."""
    records = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class ProgressFile(TrainerCallback):
    """Rank 0 appends a JSON line per event (train begin, each log, train end) to ``path``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _append(self, state, record: dict) -> None:
        if not state.is_world_process_zero:
            return
        _append_line(self.path, {**record, "step": state.global_step, "max_steps": state.max_steps})

    def on_train_begin(self, args, state, control, **kwargs):
        self._append(state, {"event": "begin"})

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._append(state, {"event": "log", **{k: v for k, v in (logs or {}).items() if isinstance(v, int | float)}})

    def on_train_end(self, args, state, control, **kwargs):
        self._append(state, {"event": "end"})


def phase(name: str, is_main: bool, **detail) -> None:
    """Rank 0 (``is_main``) appends ``{"event": "phase", "phase": name, ...detail}`` when ``CHAT_E_PROGRESS_FILE``
    is set: the parts of a run outside the training loop (:data:`PHASES`), which the Train
    page shows."""
    _rank0_record(is_main, {"event": "phase", "phase": name, **detail})


def phase_rows(name: str, is_main: bool, done: int, total: int) -> None:
    """Rank 0 appends ``{"event": "rows", "phase": name, "done", "total"}``: how far an evaluation has come (the
    replies it has scored, a pair's two replies each)."""
    _rank0_record(is_main, {"event": "rows", "phase": name, "done": done, "total": total})


def _rank0_record(is_main: bool, record: dict) -> None:
    path = os.environ.get(ENV)
    if path and is_main:
        _append_line(Path(path), record)


def _append_line(path: Path, record: dict) -> None:
    """``record`` with the time, as one JSON line appended with one ``write`` (a reader skips a line a kill cut)."""
    with path.open("a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")


def progress_callbacks() -> list[TrainerCallback]:
    """``[ProgressFile]`` when ``CHAT_E_PROGRESS_FILE`` is set, else none."""
    return [ProgressFile(os.environ[ENV])] if os.environ.get(ENV) else []


def join_run_niceness() -> None:
    """A rank of a run the app started (``CHAT_E_RUN_NICENESS`` set): its session's scheduling group gets the run's
    niceness (this module's docstring says why), before the model loads."""
    value = os.environ.get(NICENESS_ENV, "")
    if value.strip().lstrip("-").isdigit():
        set_session_niceness(int(value))
