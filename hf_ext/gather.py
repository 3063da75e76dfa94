"""Full values of sharded parameters, whichever engine sharded them: DeepSpeed ZeRO-3 (``GatheredParameters``, the
one wrapper around it) or FSDP2 (``DTensor.full_tensor``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext

from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard


def is_partitioned(tensor) -> bool:
    """True for a ZeRO-3 partitioned parameter (its ``.shape`` is the local partition, ``ds_shape`` the full one)."""
    return hasattr(tensor, "ds_id")


def is_dtensor(tensor) -> bool:
    """True for an FSDP2 (DTensor) parameter: ``.shape`` is the full shape, ``to_local()`` this rank's shard."""
    return isinstance(tensor, DTensor)


def is_sharded(tensor) -> bool:
    """True when ``tensor``'s full value exists on no single rank (ZeRO-3 or FSDP2)."""
    return is_partitioned(tensor) or is_dtensor(tensor)


def gathered(params: Iterable, modifier_rank: int | None = None):
    """A context in which the ZeRO-3 partitioned ones among ``params`` hold their full values (collective: call it on
    every rank); a no-op context when none is partitioned. With ``modifier_rank``, that rank's changes are
    scattered back to every partition on exit."""
    partitioned = [p for p in params if is_partitioned(p)]
    if not partitioned:
        return nullcontext()
    import deepspeed  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)


@contextmanager
def full_values(tensors: list) -> Iterator[list]:
    """The full value of each of ``tensors``, read-only, for the length of the context (collective when any is
    sharded: call it on every rank, with the same tensors in the same order)."""
    tensors = list(tensors)
    with gathered(tensors):
        yield [t.full_tensor() if is_dtensor(t) else t for t in tensors]


def sharding_of(model, reshard_after_forward: bool = True) -> dict | None:
    """How ``model``'s parameters are really laid out, read from its DTensors (``None``: not FSDP2): the ranks one
    parameter is split over and the copies of each shard."""
    param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
    if param is None:
        return None
    factor = replicas = 1
    for size, placement in zip(param.device_mesh.shape, param.placements):
        if isinstance(placement, Shard):
            factor *= size
        elif isinstance(placement, Replicate):
            replicas *= size
    name = "hybrid_shard" if replicas > 1 else ("full_shard" if reshard_after_forward else "shard_grad_op")
    return {"sharding": name, "sharding_factor": factor, "replicas": replicas}


def reshard(model) -> None:
    """Every FSDP2 unit of ``model`` back to its shards. The root and tied units are not resharded after a forward:
    after an evaluation or a generation their modules hold the gathered tensors, and an optimizer built then (the
    ``train()`` after an eval-only call) would hold those instead of the sharded parameters.

    A unit of several modules (the tied group) that ``generate`` entered through one module and left through another
    stays "in forward", where torch's ``reshard()`` does nothing for a unit kept gathered after forward; that unit is
    resharded with resharding-after-forward switched on for the call (torch's public setter), then off again.
    """
    for module in model.modules() if model is not None else ():
        if not isinstance(module, FSDPModule):
            continue
        module.reshard()
        if not all(is_dtensor(p) for p in module.parameters(recurse=False)):
            module.set_reshard_after_forward(True, recurse=False)
            module.reshard()
            module.set_reshard_after_forward(False, recurse=False)


@contextmanager
def root_unsharded(model):
    """For calls that enter an FSDP2 model below its root: ``generate`` runs the encoder (and the embeddings) of an
    encoder-decoder model directly, which the root unit's forward hook never sees, so the parameters outside every
    wrapped layer would stay sharded there. Gathers the root unit for the length of the context, reshards after."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        reshard(model)  # the root and every unit generate() left gathered
