"""What a preempted run tells whoever started it, in a module light enough for a launcher wrapper (no torch): the exit
status of a rank that saved its preemption checkpoint, and the preemption's record, which rank 0 writes where
:data:`RECORD_ENV` says (:func:`hf_ext.preemption.exit_if_preempted`) because a launcher's own exit status loses it
(torchrun's agent, signalled too, exits 1)."""

from __future__ import annotations

import json
import os
import time

from .atomic import write_text_atomically

#: a rank's exit status once its preemption checkpoint is saved (``EX_TEMPFAIL``: not finished, resume it)
PREEMPTED_EXIT_CODE = 75
#: where rank 0 of a preempted run writes the preemption's record (a file path; unset: no record)
RECORD_ENV = "HF_EXT_PREEMPTION_RECORD"
#: seconds within which a repeated signal is the same preemption, not a request to exit at once (SLURM signals every
#: process of a job step, and a launcher forwards the signal too)
REPEAT_WINDOW_S = 2.0


def write_preemption_record(path: str | os.PathLike, checkpoint: str, step: int, signal_name: str) -> None:
    """The record of a preemption: the checkpoint's path, its step and the signal, written all-or-nothing."""
    record = {"checkpoint": checkpoint, "step": step, "signal": signal_name, "time": time.time()}
    write_text_atomically(path, json.dumps(record) + "\n")


def read_preemption_record(path: str | os.PathLike) -> dict | None:
    """The record :func:`write_preemption_record` wrote at ``path``, or None when there is none (the run was not
    preempted, or wrote no record)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
