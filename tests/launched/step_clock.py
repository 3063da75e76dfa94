"""Wall-clock times of a launched process's milestones, for benchmarks that time restarts across processes.

``HF_EXT_TEST_CLOCK=PATH`` in a process's environment (``sitecustomize`` installs it): every ``Trainer`` of a process
that imports ``transformers.trainer`` appends one JSON line per event to PATH: ``train_begin`` (the Trainer's
``on_train_begin``: the checkpoint, if any, is loaded), ``step`` (every optimizer step's end) and ``exit`` (the
process's interpreter exits, ``sys.exit`` included; not recorded by a process that is killed), each with the rank,
the step and ``time.time()``. Lines are appended with one ``write`` each, so processes can share the file. Processes
that never import the Trainer (launchers, Ray's daemons) import nothing for it.
"""

from __future__ import annotations

import atexit
import importlib.abc
import json
import os
import sys
import time

ENV = "HF_EXT_TEST_CLOCK"


def record(event: str, rank: int | None = None, step: int | None = None) -> None:
    line = json.dumps({"event": event, "pid": os.getpid(), "rank": rank, "step": step, "time": time.time()}) + "\n"
    with open(os.environ[ENV], "a") as f:
        f.write(line)


def step_clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record("train_begin", args.process_index, state.global_step)
            atexit.register(lambda: record("exit", args.process_index, state.global_step))

        def on_step_end(self, args, state, control, **kwargs):
            record("step", args.process_index, state.global_step)

    return StepClock()


class _AfterTrainerImport(importlib.abc.MetaPathFinder):
    """Adds the clock to ``transformers.trainer.DEFAULT_CALLBACKS`` once that module has executed."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers.trainer":
            return None
        sys.meta_path.remove(self)
        spec = next(s for f in sys.meta_path if (s := f.find_spec(fullname, path, target)) is not None)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            module.DEFAULT_CALLBACKS.append(step_clock())

        spec.loader.exec_module = exec_module
        return spec


def install_from_env() -> None:
    if not os.environ.get(ENV):
        return
    trainer = sys.modules.get("transformers.trainer")  # imported already (signal_at.py imports it at start-up)
    if trainer is not None:
        trainer.DEFAULT_CALLBACKS.append(step_clock())
    else:
        sys.meta_path.insert(0, _AfterTrainerImport())
