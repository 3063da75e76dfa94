"""One rank fails, every rank stops: an agreed outcome after each step that only some ranks do.

Saving, checkpointing, resume and conversion have steps that run on one rank (the main process writes, converts,
swaps a directory in) or on each rank alone (its own checkpoint files), between collectives that every rank joins.
An exception in such a step used to leave the other ranks in their next collective until a launcher or the process
group's 30-minute timeout killed them. Here every rank leaves such a step through :func:`agree`: one all-reduce of
"which rank failed", so that the failing rank raises its own error and every other rank raises :class:`RankFailure`
naming it, at once.

A failing rank does not wait for the others for long (:data:`FAILED_RANK_WAIT`): a peer stuck in another collective
(one the failing rank skipped) is released when the failing process exits and its connections close.

Once every rank knows of the failure, each destroys its process groups when the interpreter exits (an ``atexit``
hook, which runs while the interpreter is still whole). Left to finalization, gloo's worker threads can outlive the
interpreter and abort the process ("terminate called without an active exception"), turning a clear error into a
crash report.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import sys

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: how long a rank that failed waits for the others to take note before it raises and exits anyway
FAILED_RANK_WAIT = datetime.timedelta(seconds=20)


class RankFailure(RuntimeError):
    """Another rank failed in a step this rank was waiting on; its own error is in its log."""


def _world():
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _device(dist) -> torch.device:
    """Where the process group's backend takes tensors: the CPU for gloo, the current accelerator otherwise."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return torch.device(accelerator.current_accelerator().type, accelerator.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())  # pragma: no cover - torch < 2.6


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def agree(what: str, error: BaseException | None = None) -> None:
    """Called by every rank at the same point after ``what``: raises :class:`RankFailure` on every rank that did not
    fail when some rank did. The failing rank logs its error in one line and returns (it re-raises its own)."""
    dist = _world()
    if dist is None:
        return
    rank = dist.get_rank()
    failed = torch.tensor([rank + 1 if error is not None else 0], dtype=torch.int64, device=_device(dist))
    work = dist.all_reduce(failed, op=dist.ReduceOp.MAX, async_op=True)
    if error is not None:
        logger.error(f"rank {rank} failed while {what}: {one_line(error)}")
        with contextlib.suppress(Exception):  # the others may be gone already, or stuck elsewhere
            work.wait(timeout=FAILED_RANK_WAIT)
            # every rank took note: nothing is pending in the process group, so it can be destroyed at exit (with
            # the all-reduce still queued, destroying it would wait on a peer that waits on this process's exit)
            _destroy_process_groups_at_exit()
        return
    work.wait()
    failing = int(failed.item())
    if failing:
        _destroy_process_groups_at_exit()
        raise RankFailure(f"rank {failing - 1} failed while {what} (its error is above); rank {rank} stops too.")


@contextlib.contextmanager
def shared_outcome(what: str):
    """A block every rank enters and leaves together: when it raises on any rank, it raises on every rank.

    Collectives inside the block are fine as long as every rank makes the same ones (the synced steps of a sharded
    ``generate``): a rank that fails before one of them leaves its peers in it until the failing process exits, at
    most :data:`FAILED_RANK_WAIT` later, which ends their collective with an error."""
    try:
        yield
    except BaseException as err:
        agree(what, err)
        raise
    agree(what)


def destroy_process_groups() -> None:
    """Destroy this process's process groups, DeepSpeed's comm layer's references to them first. Local: no collective."""
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and getattr(ds_comm, "cdb", None) is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()  # torch's groups and DeepSpeed's references to them
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@functools.cache  # once per process
def _destroy_process_groups_at_exit() -> None:
    atexit.register(destroy_process_groups)


def max_over_ranks(values: list[int]):
    """Start the element-wise maximum of ``values`` over every rank (one asynchronous all-reduce, to overlap with
    work every rank does next); returns a function that waits for it and gives the maxima (``values`` itself with one
    rank). Every rank must start and finish it at the same points."""
    dist = _world()
    if dist is None:
        return lambda: list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=_device(dist))
    work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)

    def result() -> list[int]:
        work.wait()
        return [int(v) for v in tensor.tolist()]

    return result
