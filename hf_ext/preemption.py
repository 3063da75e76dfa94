"""Preemption: a signal to any one rank, or to the launcher, ends the run with one checkpoint every rank agreed on.

Clusters take machines away with a signal and a grace period: SLURM sends SIGTERM (or the signal of
``--signal=USR1@120``) to every process of the job step, Kubernetes sends SIGTERM to each container and waits
``terminationGracePeriodSeconds``, torchrun and DeepSpeed's launcher pass a SIGTERM on to their workers. Stock
``Trainer`` ignores it unless ``enable_jit_checkpoint`` is set, and that sets a flag per rank that nothing agrees
across ranks, so the ranks can reach the collective save at different steps and hang.

With ``save_on_preemption`` (on by default), :class:`PreemptionCallback`

* catches the signals of ``save_on_preemption_signals`` (SIGTERM and SIGUSR1) while ``train()`` runs: the handler
  only records the signal;
* for every ``save_on_preemption_check_steps``-th optimizer step, all-reduces "which signal, on which rank" (two
  integers), started when the step begins and waited for when it ends, so that it runs while the step computes: every
  rank learns of a signal that reached any of them at the same step boundary, the end of the step after the one the
  signal arrived in;
* then has the trainer write that step's checkpoint through hf-ext's atomic path (``tmp-checkpoint-N``, renamed once
  every rank is done) and stop, skipping an evaluation due at that step;
* after ``train()`` returns, :func:`exit_if_preempted` tears the process group down and exits with
  :data:`PREEMPTED_EXIT_CODE` (75, ``EX_TEMPFAIL``: the run is not finished; ``resume_from_checkpoint=True`` goes on
  from that checkpoint). Rank 0 first writes the preemption's record (JSON: the checkpoint, its step, the signal)
  where :data:`RECORD_ENV` says: the fact a launcher's own exit status loses, for ``hf-ext launch``
  (:mod:`hf_ext.cli.launch`) and Chat-E's Train page to read (:mod:`hf_ext.exit_status`).

A signal during a checkpoint or an evaluation lets it finish; the run stops at the end of the next step. The same
signal arriving again within :data:`REPEAT_WINDOW_S` is the same request (SLURM signals every process and the launcher
forwards it too); a signal after that exits at once with ``128 + signal``, which leaves only complete checkpoints,
since a checkpoint appears under its name only when complete.

Stock's ``enable_jit_checkpoint=True`` keeps its own behaviour under hf-ext (:func:`combine_jit_checkpoint`): SIGTERM
is its signal (transformers' ``JITCheckpointCallback``: a kill wait of 3 s, a sentinel file while it saves, then
``train()`` returns), hf-ext's preemption keeps the other signals of ``save_on_preemption_signals``. With more than
one rank, the kill wait's end is a request that the ranks agree on as above, and every rank runs stock's checkpoint at
the same step end.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import CheckpointManager, JITCheckpointCallback

from .exit_status import PREEMPTED_EXIT_CODE, RECORD_ENV, REPEAT_WINDOW_S, write_preemption_record
from .ranks import max_over_ranks
from .runtime import end_distributed, local_rank

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


def parse_signal(name: str | int) -> signal.Signals:
    """``"SIGTERM"``, ``"TERM"``, ``"usr1"`` or ``15`` as a signal this process can catch; ``ValueError`` otherwise."""
    text = str(name).strip().upper()
    try:
        sig = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else "SIG" + text]
        )
    except (KeyError, ValueError):
        raise ValueError(f"{name!r} is not a signal name") from None
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ValueError(f"{sig.name} cannot be caught")
    return sig


@dataclass(kw_only=True)
class PreemptionArguments:
    """The preemption fields of every hf-ext arguments class.

    Args:
        save_on_preemption (`bool`, defaults to `True`):
            On a signal of ``save_on_preemption_signals`` to any rank or to the launcher, every rank saves one
            checkpoint at the same step boundary and the process exits with status 75 (resume it with
            ``resume_from_checkpoint=True``).
        save_on_preemption_signals (`list[str]`, defaults to ``["SIGTERM", "SIGUSR1"]``):
            The signals that mean preemption.
        save_on_preemption_check_steps (`int`, defaults to 1):
            Agree on a signal every this many optimizer steps (one all-reduce of two integers each time, overlapped
            with the step).
    """

    save_on_preemption: bool = field(
        default=True,
        metadata={
            "help": "On SIGTERM/SIGUSR1 to any rank or the launcher, every rank saves one checkpoint at the "
            "same step and the run exits with status 75 (resume with --resume_from_checkpoint True)."
        },
    )
    save_on_preemption_signals: list[str] = field(
        default_factory=lambda: list(DEFAULT_SIGNALS),
        metadata={"help": "The signals that mean preemption (default: SIGTERM SIGUSR1)."},
    )
    save_on_preemption_check_steps: int = field(
        default=1, metadata={"help": "Agree on a preemption signal every this many optimizer steps."}
    )

    def _validate_preemption(self) -> None:
        if isinstance(self.save_on_preemption_signals, str):  # "SIGTERM,SIGUSR1" from a config file
            self.save_on_preemption_signals = [s for s in self.save_on_preemption_signals.split(",") if s.strip()]
        for name in self.save_on_preemption_signals:
            try:
                parse_signal(name)
            except ValueError as err:
                raise ValueError(f"`save_on_preemption_signals`: {err}. Use names like SIGTERM or SIGUSR1.") from None
        if not isinstance(self.save_on_preemption_check_steps, int) or self.save_on_preemption_check_steps < 1:
            raise ValueError(
                f"`save_on_preemption_check_steps`={self.save_on_preemption_check_steps!r}: it must be a whole "
                "number of steps, 1 or more."
            )


class AgreedCheckpointManager(CheckpointManager):
    """Stock's JIT checkpoint manager whose kill wait ends in a request (:attr:`asked`) instead of the checkpoint
    itself: :class:`PreemptionCallback` agrees on it across ranks and runs the checkpoint on every rank at once."""

    asked = False

    def _enable_checkpoint(self):  # the kill wait's timer (stock's name: its signal handler starts it)
        logger.info("Kill wait period elapsed: every rank saves the JIT checkpoint at the same step end")
        self.asked = True


class PreemptionCallback(TrainerCallback):
    """Saves one agreed checkpoint and stops training when a preemption signal reached any rank (module docstring).
    A stock ``Trainer`` with hf-ext's arguments can use it alone: add it, then call :func:`exit_if_preempted` after
    ``train()``."""

    def __init__(self):
        self.received: int = 0  # the signal this process got (0: none)
        self.first_received_at: float | None = None
        self.saved_at: int | None = None  # the step of the preemption checkpoint
        self.signal_name: str = ""
        self._previous: dict[signal.Signals, object] = {}
        self._agreement = None  # the all-reduce started at this step's beginning: a function that waits for it
        self.jit: CheckpointManager | None = None  # stock's JIT checkpoint, when enable_jit_checkpoint=True

    def _handle(self, signum, frame) -> None:
        # in a signal handler: record, and write with os.write (no lock that the interrupted code may hold)
        now = time.monotonic()
        if not self.received:
            self.received, self.first_received_at = signum, now
            os.write(
                2,
                f"[hf-ext] {signal.Signals(signum).name} received: every rank saves a checkpoint at the end "
                "of the next step, then exits. A second signal exits at once.\n".encode(),
            )
            return
        if now - self.first_received_at < REPEAT_WINDOW_S:
            return  # the same preemption, delivered twice (the launcher forwards it, SLURM signals every process)
        os.write(
            2,
            f"[hf-ext] {signal.Signals(signum).name} again: exiting now; only complete checkpoints remain.\n".encode(),
        )
        os._exit(128 + signum)

    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self.first_received_at, self.saved_at = 0, None, None
        # a training loop started again without ending (auto_find_batch_size after an out-of-memory error) keeps the
        # handlers it has: catching again would record this callback's own handler as the one to give back
        self.release()
        if not getattr(args, "save_on_preemption", False):
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "save_on_preemption: training runs outside the main thread, where Python cannot catch "
                "signals; preemption signals keep their default action."
            )
            return
        signals = [parse_signal(name) for name in args.save_on_preemption_signals]
        if self.jit is not None:
            signals = [sig for sig in signals if sig != signal.SIGTERM]  # stock's JIT checkpoint's signal
            if args.should_log:
                logger.warning(
                    "enable_jit_checkpoint=True: SIGTERM is transformers' JIT checkpoint's (a checkpoint once its "
                    f"{self.jit.kill_wait} s kill wait is over, then train() returns"
                    + (", on every rank at the same step" if isinstance(self.jit, AgreedCheckpointManager) else "")
                    + "); save_on_preemption keeps "
                    + (" and ".join(sig.name for sig in signals) + " (exit status 75)." if signals else "no signal.")
                )
        for sig in signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def on_step_begin(self, args, state, control, **kwargs):
        # the all-reduce runs while the step computes: the ranks only wait for it at the step's end
        agreed_jit = isinstance(self.jit, AgreedCheckpointManager)
        if (self._previous or agreed_jit) and (state.global_step + 1) % args.save_on_preemption_check_steps == 0:
            asked = int(agreed_jit and self.jit.asked)
            self._agreement = max_over_ranks([self.received, args.process_index + 1 if self.received else 0, asked])

    def on_step_end(self, args, state, control, **kwargs):
        if self._agreement is None:
            return
        signum, rank, jit_asked = self._agreement()
        self._agreement = None
        if jit_asked:  # what stock's JITCheckpointCallback does at a step end, on every rank at this one
            control.should_save, control.should_training_stop = False, True
            self.jit.asked = False
            self.jit.execute_jit_checkpoint()
            if signum:  # that checkpoint is this step's: hf-ext's signal only adds the exit status
                self.saved_at, self.signal_name = state.global_step, signal.Signals(signum).name
            return
        if not signum:
            return
        control.should_save, control.should_training_stop, control.should_evaluate = True, True, False
        self.saved_at, self.signal_name = state.global_step, signal.Signals(signum).name
        logger.warning(
            f"{self.signal_name} reached rank {rank - 1}: every rank saves checkpoint-{state.global_step} and stops."
        )

    def on_train_end(self, args, state, control, **kwargs):
        if self._agreement is not None:  # started by the last step, which ended the run: nothing left pending
            self._agreement()
            self._agreement = None
        if self.saved_at is None:
            self.release()
        # else the handlers stay until exit_if_preempted: a launcher signalling the ranks now must not kill one

    def release(self, ignore: bool = False) -> None:
        """Give the caught signals their previous handlers back (``ignore``: ignore them from now on)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore else previous)
        self._previous = {}


def combine_jit_checkpoint(trainer) -> None:
    """When ``enable_jit_checkpoint=True`` added stock's ``JITCheckpointCallback``: SIGTERM stays its signal, and with
    more than one rank its kill wait ends in a request that :class:`PreemptionCallback` agrees on across ranks (stock's
    per-rank flag would send the ranks into the collective save at different steps)."""
    jit = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, JITCheckpointCallback)), None)
    ours = preemption_callback(trainer)
    if jit is None or jit.jit_manager is None or ours is None:
        return
    if trainer.args.world_size > 1:
        stock = jit.jit_manager
        agreed = AgreedCheckpointManager(trainer, kill_wait=stock.kill_wait)
        agreed._original_sigterm_handler = stock._original_sigterm_handler  # what stock's on_train_end restores
        signal.signal(signal.SIGTERM, agreed._sigterm_handler)
        jit.jit_manager = agreed
    ours.jit = jit.jit_manager


def preemption_callback(trainer) -> PreemptionCallback | None:
    """The trainer's :class:`PreemptionCallback` (None: a trainer without one)."""
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PreemptionCallback)), None)


def release_signals(trainer) -> None:
    """Give the preemption signals their previous handlers back (a ``train()`` that raised: no ``on_train_end``)."""
    if (callback := preemption_callback(trainer)) is not None:
        callback.release()


def exit_if_preempted(trainer) -> None:
    """After ``train()``: when it stopped for a preemption, tear down the process group and exit with
    :data:`PREEMPTED_EXIT_CODE` (the checkpoint is complete on disk); otherwise nothing."""
    callback = preemption_callback(trainer)
    if callback is None or callback.saved_at is None:
        return
    if (record := os.environ.get(RECORD_ENV)) and trainer.is_world_process_zero():
        checkpoint = os.path.join(os.path.abspath(trainer.args.output_dir), f"checkpoint-{callback.saved_at}")
        write_preemption_record(record, checkpoint, callback.saved_at, callback.signal_name)
    if trainer.args.should_log:
        logger.warning(
            f"Preempted ({callback.signal_name}): checkpoint-{callback.saved_at} is saved in "
            f"{trainer.args.output_dir}; exiting with status {PREEMPTED_EXIT_CODE}. Resume with "
            "resume_from_checkpoint=True (--resume_from_checkpoint True)."
        )
    end_distributed()
    # a launcher's worker ignores the launcher's own SIGTERM while it exits (when one rank exits first, torchrun and
    # DeepSpeed's launcher signal the others); in-process, the signals get their previous handlers back
    callback.release(ignore=local_rank() is not None)
    sys.exit(PREEMPTED_EXIT_CODE)
