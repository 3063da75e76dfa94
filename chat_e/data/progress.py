"""A training's progress as JSON lines, written by the training (:class:`chat_e.training.progress.ProgressFile`) for
whoever watches it from another process (the app's training runs, :mod:`chat_e.studio.runs`).

``CHAT_E_PROGRESS_FILE`` names the file (the environment reaches every rank under any launcher); rank 0 appends one
line per event: ``{"event": "begin", ...}``, then ``{"event": "log", ...}`` with what the Trainer logged (loss,
learning rate; DPO's ``rewards/margins`` and ``rewards/accuracies``), then ``{"event": "end", ...}``, each with
``step``, ``max_steps`` and ``time``. Each line is written whole with one ``write``; a reader skips a last line cut
short by a kill.
"""

from __future__ import annotations

import json
from pathlib import Path

ENV = "CHAT_E_PROGRESS_FILE"


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
