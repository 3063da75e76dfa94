"""Where we run: launcher detection, accelerator presence and CPU thread placement."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

# Read once, at import, before accelerate or DeepSpeed rewrite them: only the user's and the launcher's values count
# (accelerate's PartialState overwrites LOCAL_WORLD_SIZE, with 1, under DeepSpeed's launcher).
_LAUNCH_KEYS = ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
LAUNCH_ENV = {key: os.environ[key] for key in _LAUNCH_KEYS if key in os.environ}
USER_OMP_NUM_THREADS = LAUNCH_ENV.get("OMP_NUM_THREADS")


def has_accelerator() -> bool:
    """True when torch sees a GPU (CUDA/ROCm), XPU, MPS, HPU, NPU... — anything but the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch < 2.6


def launched_by_deepspeed() -> bool:
    """True under DeepSpeed's own launcher (``deepspeed script.py``), which sets ``CROSS_RANK`` and ``LOCAL_SIZE``."""
    return "CROSS_RANK" in os.environ and "LOCAL_SIZE" in os.environ


def local_world_size() -> int:
    """Processes on this node, whatever launched them (torchrun, accelerate, deepspeed, mpirun)."""
    for env in (LAUNCH_ENV, os.environ):  # the launcher's values first, then what this process learned since
        for key in _LAUNCH_KEYS[1:]:
            if env.get(key, "").isdigit():
                return max(1, int(env[key]))
    return 1


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def place_cpu_threads() -> int:
    """Give each local rank ``cores // local ranks`` intra-op threads unless the user set ``OMP_NUM_THREADS``.

    Under ``deepspeed --num_gpus 2`` on 2 cores, accelerate leaves 2 threads per rank; the two ranks then fight for the
    cores and a tiny model trains 2.6x slower than with 1 thread per rank. Returns the thread count in force.
    """
    if USER_OMP_NUM_THREADS:
        return torch.get_num_threads()
    threads = max(1, usable_cores() // local_world_size())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        logger.info(
            f"Using {threads} CPU threads per rank ({usable_cores()} cores, {local_world_size()} local ranks)."
        )
    return threads


def _detect_launcher(env) -> str:
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "deepspeed"
    if any(key.startswith("ACCELERATE_") for key in env) and "LOCAL_RANK" in env:
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    return "python"


#: what started this process: deepspeed, accelerate, torchrun, mpi or python (read at import, like LAUNCH_ENV)
LAUNCHER = _detect_launcher(os.environ)


def run_summary(trainer) -> dict:
    """Where and how a trainer ran: launcher, world size, engine, ZeRO stage, threads (for logs and checks)."""
    import torch.distributed as dist

    engine = trainer.model_wrapped
    stage = getattr(engine, "zero_optimization_stage", None)
    return {
        "launcher": LAUNCHER,
        "world_size": dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
        "engine": type(engine).__name__,
        "zero_stage": stage() if callable(stage) else None,
        "device": str(trainer.args.device),
        "torch_threads": torch.get_num_threads(),
    }


def end_distributed() -> None:
    """Wait for every rank, then tear the default process group down.

    Call it last in a distributed script. Left to the interpreter's exit, the gloo process group can be destroyed while
    a peer still talks to it, and a rank that finished cleanly aborts ("terminate called without an active exception",
    exit code -6), which the launcher reports as a failed run.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        release_deepspeed_shm_names()
        dist.barrier()
        dist.destroy_process_group()


_SHM_RELEASED = False


def _deepspeed_shm_path(rank: int) -> str | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port and hasattr(os, "getuid")):
        return None
    # the name DeepSpeed's CPU shm comm op gives rank ``rank``'s workspace (deepspeed/ops/csrc/cpu/comm/shm.cpp)
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_deepspeed_shm_names() -> None:
    """Unlink the shared-memory files DeepSpeed's CPU comm op creates, once every rank has mapped them.

    On CPU, DeepSpeed allocates a 66 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` workspace per rank and never unlinks
    it: every run leaks them into ``/dev/shm``, which is RAM (a 2-rank test suite leaks gigabytes). Once all ranks have
    opened each other's workspaces the names are no longer needed; unlinking them keeps the mappings valid and lets
    the kernel free the memory when the processes exit, however they exit. Collective: call it on every rank.
    """
    global _SHM_RELEASED
    if _SHM_RELEASED:
        return
    import torch.distributed as dist

    try:
        from deepspeed.comm import comm as ds_comm
    except ImportError:  # pragma: no cover - DeepSpeed is a dependency
        return
    backend = getattr(ds_comm, "cdb", None)
    if backend is None or getattr(backend, "shm_comm_op", None) is None or not dist.is_initialized():
        return
    path = _deepspeed_shm_path(dist.get_rank())
    if path is None:
        return
    dist.barrier()  # initialize() returned on every rank: each has mapped every other rank's workspace
    if os.path.exists(path):
        os.unlink(path)
    _SHM_RELEASED = True
