"""Stock's just-in-time checkpoint (``enable_jit_checkpoint=True``, documented by transformers for SLURM and
Kubernetes): a real SIGTERM to the training process, a kill wait, then one checkpoint of the step it was taken at
(a sentinel file beside it while it is written), ``train()`` returning as usual, and the run resumable from it.
Both sides behave alike (docs/drop-in.md#jit-checkpoint); hf-ext's agreement of that checkpoint across ranks is
checked in tests/distributed/test_engines.py."""

from __future__ import annotations

import os
import signal
import time

from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from .regression import EventLog, trainer, weights

STEPS = 8
#: transformers' documented kill wait: the checkpoint is requested this many seconds after SIGTERM
KILL_WAIT_S = 3.0


class SigtermThenStall(TrainerCallback):
    """At the end of step ``at``: a real SIGTERM to this process, then 1 s there (under the kill wait); at the end of
    the next step, the rest of the kill wait and 0.5 s more. A run whose checkpoint waits for the kill wait saves
    at the first step begin after that second stall: step ``at + 1``'s checkpoint (one that did not wait would save
    step ``at``'s)."""

    def __init__(self, at: int):
        self.at, self.sent = at, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            self.sent = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        elif state.global_step == self.at + 1:
            time.sleep(max(0.0, self.sent + KILL_WAIT_S + 0.5 - time.monotonic()))


def _jit_trainer(peer, out, *callbacks):
    return trainer(
        peer, out, enable_jit_checkpoint=True, max_steps=STEPS, save_strategy="no", callbacks=list(callbacks)
    )


def test_sigterm_saves_one_checkpoint_after_the_kill_wait_and_the_run_resumes_from_it(peer, tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    full = trainer(peer, tmp_path / "full", max_steps=STEPS, save_strategy="no")
    full.train()

    run = _jit_trainer(peer, tmp_path / "cut", SigtermThenStall(at=2))
    assert sum(isinstance(cb, JITCheckpointCallback) for cb in run.callback_handler.callbacks) == 1
    assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_DFL)  # caught from construction on
    run.train()  # returns: no exit status of its own
    assert signal.getsignal(signal.SIGTERM) == before  # given back when training ends

    # saved at step 4's beginning, after the kill wait: step 3's checkpoint, complete, its sentinel gone; the
    # step that was already under way ran, then training stopped
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["checkpoint-3"]
    checkpoint = tmp_path / "cut" / "checkpoint-3"
    assert not (checkpoint / "checkpoint-is-incomplete.txt").exists()
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "model.safetensors").is_file()
    assert run.state.global_step == 4

    log = EventLog()
    resumed = _jit_trainer(peer, tmp_path / "cut", log)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert log.steps_at_train_begin == [3] and resumed.state.global_step == STEPS
    assert weights(resumed.model) == weights(full.model)  # same data order, same RNG: bit for bit
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["checkpoint-3"]  # no SIGTERM: nothing saved
