"""Evaluation before any DeepSpeed engine exists (an eval-only run) on ZeRO-1/2.

The stock ``evaluation_loop`` builds an inference engine with ``deepspeed_init(inference=True)`` when no engine exists
yet, and that raises "ZeRO inference only makes sense with ZeRO Stage 3" on stages 0-2. There the weights are whole on
every rank (only optimizer states and gradients are partitioned), so the plain module evaluates the same: no engine is
needed, and none is built.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

logger = logging.getLogger(__name__)


def needs_plain_eval(trainer) -> bool:
    """True for a DeepSpeed run below ZeRO-3 whose engine does not exist yet (nothing was trained in this process)."""
    if not getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "deepspeed", None) is not None:
        return False
    return not is_deepspeed_zero3_enabled()


@contextmanager
def plain_eval_without_engine(trainer):
    """Within this context the trainer evaluates the plain module when :func:`needs_plain_eval` says so.

    The module is placed on the device as in a run without DeepSpeed, and the accelerator forgets it on the way out,
    so a later ``train()`` builds its engine as usual.
    """
    if not needs_plain_eval(trainer):
        yield
        return
    logger.info("Eval-only on ZeRO-1/2: the weights are not partitioned, evaluating the plain module.")
    models = getattr(trainer.accelerator, "_models", None)
    registered = list(models) if models is not None else None
    trainer.is_deepspeed_enabled = False
    try:
        yield
    finally:
        trainer.is_deepspeed_enabled = True
        if registered is not None:
            models[:] = registered
