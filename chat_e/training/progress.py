"""The training's side of :mod:`chat_e.data.progress`: :class:`ProgressFile`, added by the training modules when
``CHAT_E_PROGRESS_FILE`` names a file, and :func:`join_run_niceness`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from transformers import TrainerCallback

# absolute import: chat_e.training.dialogue, which imports this, is loaded by its path under Ray Train
from chat_e.data.progress import ENV, NICENESS_ENV, set_session_niceness


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
    is set: the parts of a run outside the training loop (:data:`chat_e.data.progress.PHASES`), which the Train
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
    niceness (:mod:`chat_e.data.progress`), before the model loads."""
    value = os.environ.get(NICENESS_ENV, "")
    if value.strip().lstrip("-").isdigit():
        set_session_niceness(int(value))
