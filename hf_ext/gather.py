"""The one wrapper around DeepSpeed's ``GatheredParameters``: full values of ZeRO-3 partitioned parameters."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext


def is_partitioned(tensor) -> bool:
    """True for a ZeRO-3 partitioned parameter (its ``.shape`` is the local partition, ``ds_shape`` the full one)."""
    return hasattr(tensor, "ds_id")


def gathered(params: Iterable, modifier_rank: int | None = None):
    """A context in which the ZeRO-3 partitioned ones among ``params`` hold their full values (collective: call it on
    every rank); a no-op context when none is partitioned. With ``modifier_rank``, that rank's changes are
    scattered back to every partition on exit."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)
