"""Resuming into a longer (or shorter) run: the learning rate of the first resumed step.

A resumed run rebuilds its LR scheduler for the new number of steps and loads the checkpoint's scheduler state (the
step it reached), but the optimizer's state holds the learning rate the *old* schedule set last. That rate is what
the first resumed step uses: resuming ``checkpoint-10`` of a 10-step linear run with ``max_steps=20`` trains step 11
at learning rate 0, silently (stock transformers does the same). :class:`ResumedScheduleCallback` sets the
optimizer's learning rate from the schedule of the run being resumed at the step it resumes from, and says so in
one line when that changes anything; a ``max_steps`` below the checkpoint's step is an error.
"""

from __future__ import annotations

import logging
import math

from torch.optim.lr_scheduler import LambdaLR
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


def inner_scheduler(scheduler):
    """The schedule itself: accelerate wraps it (and its DeepSpeed wrapper's ``step`` does nothing)."""
    while scheduler is not None and hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler
    return scheduler


def scheduled_lrs(scheduler) -> list[float] | None:
    """The learning rate of each parameter group at the scheduler's current step, from the schedule itself (not from
    the optimizer): transformers' ``LambdaLR`` schedules and DeepSpeed's own schedulers; ``None`` for others."""
    if isinstance(scheduler, LambdaLR):
        return [base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    if hasattr(scheduler, "last_batch_iteration") and callable(getattr(scheduler, "get_lr", None)):
        return list(scheduler.get_lr())  # DeepSpeed's schedulers compute from last_batch_iteration
    return None


class ResumedScheduleCallback(TrainerCallback):
    """On resume: refuse a ``max_steps`` below the checkpoint's step, and start from the learning rate the current
    schedule gives the resumed step (the optimizer's saved one belongs to the schedule the checkpoint was trained
    with)."""

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        step = state.global_step
        if step == 0:
            return
        if state.max_steps < step:
            raise ValueError(
                f"The checkpoint is at step {step} but this run stops at max_steps={state.max_steps}: nothing to "
                f"train. Pass --max_steps above {step} to continue it, or start from an earlier checkpoint."
            )
        scheduler = inner_scheduler(lr_scheduler)
        lrs = scheduled_lrs(scheduler) if scheduler is not None else None
        groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
        if lrs is None or not groups or len(groups) != len(lrs):
            return
        saved = [group["lr"] for group in groups]
        if all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(saved, lrs)):
            return  # the same schedule as the checkpoint's: nothing to say
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        logger.warning(
            f"Resumed at step {step} of {state.max_steps}: learning rate set to {lrs[0]:.3g} from this run's schedule "
            f"(the checkpoint's optimizer held {saved[0]:.3g}, from the schedule it was trained with)."
        )
