"""What a run the app started and the app tell each other through the environment: the training's progress as JSON
lines, and the run's niceness.

The progress: a training's progress as JSON lines, written by the training (:class:`chat_e.training.progress.ProgressFile`) for
whoever watches it from another process (the app's training runs, :mod:`chat_e.studio.runs`).

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
from pathlib import Path

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
