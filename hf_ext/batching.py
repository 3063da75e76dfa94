"""A global batch split over ranks: micro-batch x gradient accumulation (the DeepSpeed config's batch keys and a
resume on another number of ranks share the rule)."""

from __future__ import annotations


def split_batch(total: int, world: int, micro: int) -> tuple[int, int]:
    """The micro-batch (the largest divisor of ``total / world`` up to ``micro``) and accumulation that give a global
    batch of ``total`` on ``world`` ranks; ``total`` must be a multiple of ``world``."""
    per_rank = total // world
    new_micro = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
    return new_micro, per_rank // new_micro
