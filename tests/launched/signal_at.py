"""A real signal to a real process at an exact training step, for the preemption tests.

``HF_EXT_TEST_SIGNAL_AT="STEP:SIGNAL:TARGET[:RANK]"`` in a launched rank's environment (``sitecustomize`` installs it
into every ``Trainer`` of that process through ``transformers.trainer.DEFAULT_CALLBACKS``): at the end of optimizer
step STEP, rank RANK (default 1) sends SIGNAL to TARGET: ``self`` (that rank only), ``launcher`` (its parent
process: torchrun's agent, DeepSpeed's launcher) or ``command`` (``hf-ext launch``, the command a scheduler runs:
``HF_EXT_LAUNCH_PID``). In-process tests add :class:`SignalAt` to a trainer directly.
"""

from __future__ import annotations

import os
import signal
import time

from transformers import TrainerCallback

ENV = "HF_EXT_TEST_SIGNAL_AT"


class SignalAt(TrainerCallback):
    def __init__(self, step: int, sig: str = "SIGTERM", target: str = "self", rank: int = 1):
        self.step, self.sig, self.target, self.rank = step, signal.Signals[sig], target, rank

    @classmethod
    def from_env(cls, value: str) -> SignalAt:
        step, sig, target, *rank = value.split(":")
        return cls(int(step), sig, target, int(rank[0]) if rank else 1)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or args.process_index != min(self.rank, args.world_size - 1):
            return
        if self.target == "command":
            pid = int(os.environ["HF_EXT_LAUNCH_PID"])  # a KeyError outside hf-ext launch: never pid 0, the group
        else:
            pid = os.getppid() if self.target == "launcher" else os.getpid()
        print(f"rank {args.process_index}: {self.sig.name} to {self.target} (pid {pid}) at step {self.step} at "
              f"{time.time()}", flush=True)  # fmt: skip
        os.kill(pid, self.sig)


def install_from_env() -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    import transformers.trainer  # noqa: PLC0415 (only in the processes that asked for it: the import is slow)

    callback = SignalAt.from_env(value)
    transformers.trainer.DEFAULT_CALLBACKS.append(callback)
