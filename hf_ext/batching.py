"""A global batch split over ranks: micro-batch x gradient accumulation (the DeepSpeed config's batch keys and a
resume on another number of ranks share the rule), and the ranks it is split over: the data-parallel ones, which are
all ranks unless tensor, sequence or context parallelism groups them (:class:`Layout`)."""

from __future__ import annotations

from dataclasses import dataclass


def split_batch(total: int, world: int, micro: int) -> tuple[int, int]:
    """The micro-batch (the largest divisor of ``total / world`` up to ``micro``) and accumulation that give a global
    batch of ``total`` on ``world`` ranks; ``total`` must be a multiple of ``world``."""
    per_rank = total // world
    new_micro = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
    return new_micro, per_rank // new_micro


@dataclass(frozen=True)
class Layout:
    """How ``world`` ranks divide into model-parallel groups: tensor (``tp``: DeepSpeed AutoTP, accelerate's
    ``ParallelismConfig.tp_size``), sequence (``sp``: Ulysses/ALST) and context (``cp``) parallel, and the
    data-parallel ranks that remain, each of which takes its own micro-batches. Stock's arithmetic
    (``Trainer.get_total_train_batch_size``): ``dp = world // (tp * sp * cp)``."""

    world: int
    tp: int = 1
    sp: int = 1
    cp: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tp * self.sp * self.cp

    @property
    def dp(self) -> int:
        """The data-parallel ranks: the ranks a global batch is split over (the ranks of one tensor-, sequence- or
        context-parallel group share each micro-batch)."""
        return max(1, self.world // self.model_parallel)

    @property
    def deepspeed_ranks(self) -> int:
        """The world size DeepSpeed's ``train_batch_size`` counts: every rank but the sequence-parallel ones.
        DeepSpeed parses its config before AutoTP forms its groups and, under the Trainer, without a model-parallel
        unit, so its batch check counts tensor-parallel ranks (a 2-rank AutoTP run of 2 x 2 rows asserts
        ``train_batch_size`` 8, tests/distributed/test_parallel_layouts.py); the Ulysses unit accelerate passes it
        divides the world by the sequence-parallel size."""
        return max(1, self.world // self.sp)

    def ranks(self, deepspeed: bool = False) -> str:
        """``4 ranks``, or ``2 data-parallel ranks (4 ranks / tensor-parallel 2)``, or with ``deepspeed`` the ranks
        DeepSpeed's ``train_batch_size`` counts (:attr:`deepspeed_ranks`): for messages about a batch."""
        count, sizes = (
            (self.deepspeed_ranks, {"sequence-parallel": self.sp})
            if deepspeed
            else (self.dp, {"tensor-parallel": self.tp, "sequence-parallel": self.sp, "context-parallel": self.cp})
        )
        parts = [f"{name} {size}" for name, size in sizes.items() if size > 1]
        if not parts:
            return f"{self.world} ranks" if self.world != 1 else "1 rank"
        return f"{count} data-parallel rank{'s' if count != 1 else ''} ({self.world} ranks / {' x '.join(parts)})"

    def problem(self) -> str | None:
        """Why the world cannot be divided this way, or ``None``."""
        if self.world % self.model_parallel:
            return (
                f"{self.world} ranks cannot be divided into groups of tensor-parallel {self.tp} x sequence-parallel "
                f"{self.sp} x context-parallel {self.cp} = {self.model_parallel}"
            )
        return None


def _size(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def layout_of(world: int, deepspeed_config: dict | None = None, parallelism_config=None, model=None) -> Layout:
    """The :class:`Layout` of ``world`` ranks, read where stock reads it (``Trainer.get_tp_size`` and friends): the
    tensor-parallel size from the model's ``_tp_size``, else the DeepSpeed config's ``tensor_parallel.autotp_size``,
    else accelerate's ``parallelism_config``; sequence- and context-parallel sizes from ``parallelism_config`` (and
    the DeepSpeed config's ``sequence_parallel_size``, which DeepSpeed divides its world by)."""
    ds = deepspeed_config if isinstance(deepspeed_config, dict) else {}
    tensor = ds.get("tensor_parallel") if isinstance(ds.get("tensor_parallel"), dict) else {}
    tp = getattr(model, "_tp_size", None)
    if tp is None:
        tp = tensor.get("autotp_size") if "autotp_size" in tensor else getattr(parallelism_config, "tp_size", None)
    sp = getattr(parallelism_config, "sp_size", None) or ds.get("sequence_parallel_size")
    cp = getattr(parallelism_config, "cp_size", None)
    return Layout(int(world), _size(tp), _size(sp), _size(cp))


def args_layout(args) -> Layout:
    """The :class:`Layout` of a run's ``TrainingArguments``: its world size, its DeepSpeed config (resolved, or as
    given when a dict) and its ``parallelism_config``."""
    deepspeed_config = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if deepspeed_config is None and isinstance(getattr(args, "deepspeed", None), dict):
        deepspeed_config = args.deepspeed
    return layout_of(args.world_size, deepspeed_config, getattr(args, "parallelism_config", None))
