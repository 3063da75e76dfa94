"""Where a run happens and what it needs from the process: launcher, accelerator, cores, threads, DeepSpeed's comm
layer on CPU, shared-memory and malloc housekeeping, and a clean end.

The queries (``detect_launcher``, ``has_accelerator``, ``Hardware``, ``local_world_size``, ``usable_cores``) have no
side effects. The actions run from two places only: :func:`start_deepspeed_comm` where stock ``TrainingArguments``
starts the process group (its device set-up), and :func:`prepare_run` once per process when the trainer starts
training or evaluating.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from dataclasses import dataclass

import psutil
import torch
import torch.distributed as dist

from .ranks import destroy_process_groups

logger = logging.getLogger(__name__)

# Read once, at import, before accelerate or DeepSpeed rewrite them: only the user's and the launcher's values count
# (accelerate's PartialState overwrites LOCAL_WORLD_SIZE, with 1, under DeepSpeed's launcher).
_LAUNCH_KEYS = ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def read_launch_env() -> None:
    """Keep the launcher's and the user's values of the variables above, as this process's environment has them now.
    Called at import; a process forked after its imports with another environment (the tests' preloaded interpreter,
    tests/launched/zygote.py) calls it again."""
    global LAUNCH_ENV, USER_OMP_NUM_THREADS
    LAUNCH_ENV = {key: os.environ[key] for key in _LAUNCH_KEYS if key in os.environ}
    USER_OMP_NUM_THREADS = LAUNCH_ENV.get("OMP_NUM_THREADS")


LAUNCH_ENV: dict[str, str] = {}
USER_OMP_NUM_THREADS: str | None = None
read_launch_env()


def detect_launcher(env=None) -> str:
    """What started this process: ``deepspeed``, ``ray``, ``accelerate``, ``torchrun``, ``mpi`` or ``python``."""
    env = os.environ if env is None else env
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:  # DeepSpeed's launcher sets both
        return "deepspeed"
    if "RAY_RAYLET_PID" in env:  # a Ray worker (Ray Train also sets ACCELERATE_TORCH_DEVICE and LOCAL_RANK)
        return "ray"
    if any(key.startswith("ACCELERATE_") for key in env) and "LOCAL_RANK" in env:
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    return "python"


#: the launcher as seen at import, before accelerate adds its own variables
LAUNCHER = detect_launcher()


def launched_by_deepspeed() -> bool:
    """True under DeepSpeed's own launcher (``deepspeed script.py``)."""
    return detect_launcher() == "deepspeed"


def launch_world_size() -> int:
    """The world size the launcher announced (``WORLD_SIZE``; 1 when run as a plain script)."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def restart_hazard(env=None) -> str | None:
    """One line when this launch restarts failed workers (torchrun's ``--max-restarts``, accelerate's
    ``--max_restarts``: after a preemption's exit 75 too) through the rendezvous store its agent shares with them:
    torch keeps that store across attempts, so a restarted group can read the previous attempt's addresses and fail to
    connect (Gloo's "connectFullMesh failed ... Connection refused", NCCL's; pytorch/pytorch#135712, #167288). Static
    rendezvous (``--master_port``) always shares it, c10d's since torch 2.5 unless
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. ``None``: no restarts, one rank, or a store per attempt."""
    env = os.environ if env is None else env
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    world = env.get("WORLD_SIZE", "1")
    if not (restarts.isdigit() and int(restarts) > 0 and world.isdigit() and int(world) > 1):
        return None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"this launch restarts failed workers (up to {restarts} times) through the rendezvous store torch's elastic "
        "agent shares with them, where a restarted group can read the last attempt's addresses and fail to connect "
        "(pytorch/pytorch#135712). Launch with --rdzv-backend c10d (accelerate: --rdzv_backend c10d) and "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/cluster.md)."
    )


def has_accelerator() -> bool:
    """True when torch sees a GPU (CUDA/ROCm), XPU, MPS, HPU, NPU... — anything but the CPU."""
    return bool(torch.accelerator.is_available())


@dataclass(frozen=True)
class Hardware:
    """Where training runs and which half precisions it supports (as DeepSpeed's accelerator reports them)."""

    device: str
    fp16: bool
    bf16: bool

    @classmethod
    def detect(cls, use_cpu: bool = False) -> Hardware:
        if use_cpu or not has_accelerator():
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator  # noqa: PLC0415 (slow, probes the accelerator: only where the hardware is detected)

            accelerator = CPU_Accelerator()
        else:
            from deepspeed.accelerator import get_accelerator  # noqa: PLC0415 (slow, probes the accelerator: only where the hardware is detected)

            accelerator = get_accelerator()
        return cls(
            accelerator.device_name(), bool(accelerator.is_fp16_supported()), bool(accelerator.is_bf16_supported())
        )

    def default_precision(self) -> str | None:
        """bf16, else fp16, on an accelerator; full fp32 on CPU (where half precision trains slower, not faster)."""
        if self.device == "cpu":
            return None
        return "bf16" if self.bf16 else "fp16" if self.fp16 else None


def local_world_size() -> int:
    """Processes on this node, whatever launched them (torchrun, accelerate, deepspeed, mpirun)."""
    for env in (LAUNCH_ENV, os.environ):  # the launcher's values first, then what this process learned since
        for key in _LAUNCH_KEYS[1:]:
            if env.get(key, "").isdigit():
                return max(1, int(env[key]))
    return 1


def local_rank() -> int | None:
    """This process's rank on its node (``LOCAL_RANK``, set by every launcher); ``None`` when run as a plain script."""
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


def host_memory_per_rank(local_ranks: int) -> int:
    """The host's available RAM, shared by the ``local_ranks`` processes on this node: a CPU rank's share."""
    return int(psutil.virtual_memory().available // max(1, local_ranks))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def place_cpu_threads() -> int:
    """Give each local rank ``cores // local ranks`` intra-op threads unless the user set ``OMP_NUM_THREADS``.

    Under ``deepspeed --num_gpus 2`` on 2 cores, accelerate leaves 2 threads per rank; the two ranks then fight for the
    cores (docs/benchmarks.md, "Launchers and CPU threads"). Returns the thread count in force.
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


# --- actions ----------------------------------------------------------------------------------------------------


def start_deepspeed_comm() -> None:
    """Bring up DeepSpeed's comm layer on the process group stock ``TrainingArguments`` just created.

    On an accelerator, stock's device set-up (accelerate's ``PartialState`` with DeepSpeed) starts it; on CPU
    (``use_cpu``) accelerate starts torch.distributed but not DeepSpeed's comm, and ``zero.Init`` in
    ``from_pretrained`` would then see a world of one rank. Called from the same place, for the same reason.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    import deepspeed  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)
    import deepspeed.comm as ds_comm  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend())


def wants_freed_memory_released(args) -> bool:
    """``args.release_freed_memory``, or when it is None (the default): whether the memory planner planned the run.

    Releasing costs page faults (every large allocation then starts with fresh pages), so it is on where memory is
    the point: when the run was fitted to a budget, whose plan assumes it, or when asked for.
    """
    wanted = getattr(args, "release_freed_memory", None)
    if wanted is None:
        return getattr(args, "memory_plan", None) is not None
    return bool(wanted)


def return_freed_memory_to_os(threshold: int = 64 * 1024) -> bool:
    """Make glibc hand large freed blocks back to the OS instead of keeping them in its heap (CPU training; Chat-E's
    server, whose large request bodies come and go).

    ZeRO-2/3 allocate and free many mid-sized temporaries (gathered parameters, flattened gradients) every step;
    glibc serves blocks under its adaptive mmap threshold (up to 32 MiB) from the heap and keeps them after
    ``free``, so the resident set grows far beyond what is live (docs/benchmarks.md, "Memory"). Blocks of
    ``threshold`` bytes or more are mmapped (returned on free) and the heap is trimmed eagerly. The price is page
    faults: each such allocation starts from fresh pages. No effect (False) where glibc's ``mallopt`` is
    unavailable, or when the user set ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    done = bool(mallopt(m_mmap_threshold, threshold)) and bool(mallopt(m_trim_threshold, 0))
    if done:
        trim_heap()  # what model loading freed before now goes back too
    return done


def trim_heap() -> None:
    """Hand the free memory at the top of glibc's heaps back to the OS (``malloc_trim``); a no-op elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class RunSetup:
    """What :func:`prepare_run` did: torch threads per rank, and whether freed memory goes back to the OS."""

    torch_threads: int
    released_freed_memory: bool


_RUN_SETUP: RunSetup | None = None


def prepare_run(args) -> RunSetup:
    """The process-wide set-up of a run, done once per process when the trainer first trains or evaluates.

    On CPU: ``cores // local ranks`` torch threads per rank unless the user set ``OMP_NUM_THREADS``, and freed
    memory handed back to the OS when the memory planner planned the run (or ``release_freed_memory`` asks). Under
    distributed DeepSpeed on CPU, the names of its shared-memory workspaces are unlinked (a collective: every rank
    starts training or evaluating, so every rank gets here). A launch whose restarted workers may not reconnect
    (:func:`restart_hazard`) is told so, by rank 0.
    """
    global _RUN_SETUP
    if _RUN_SETUP is not None:
        return _RUN_SETUP
    released = False
    if args.device.type == "cpu":
        place_cpu_threads()
        released = wants_freed_memory_released(args) and return_freed_memory_to_os()
    release_deepspeed_shm_names()
    hazard = restart_hazard()
    if hazard and args.should_log:
        logger.warning(hazard)
    _RUN_SETUP = RunSetup(torch.get_num_threads(), released)
    return _RUN_SETUP


def run_summary(trainer) -> dict:
    """Where and how a trainer ran: launcher, world size, nodes, ranks per node, engine, ZeRO stage or FSDP sharding,
    threads (for logs and checks)."""
    from .gather import sharding_of  # noqa: PLC0415 (torch.distributed.fsdp, slow: kept off the chat-e --help path)

    engine = trainer.model_wrapped
    stage = getattr(engine, "zero_optimization_stage", None)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    per_node = min(local_world_size(), world)
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    fsdp = sharding_of(engine, getattr(plugin, "reshard_after_forward", True)) if plugin is not None else None
    return {
        "launcher": LAUNCHER,
        "world_size": world,
        "nodes": max(1, world // per_node),
        "ranks_per_node": per_node,
        "engine": "FSDP2" if fsdp is not None else type(engine).__name__,
        "zero_stage": stage() if callable(stage) else None,
        "fsdp": fsdp,  # sharding, sharding_factor, replicas: read from the parameters themselves
        "device": str(trainer.args.device),
        "torch_threads": torch.get_num_threads(),
        "released_freed_memory": bool(_RUN_SETUP and _RUN_SETUP.released_freed_memory),
    }


def _deepspeed_engines() -> list:
    """The DeepSpeed engines alive in this process (a trainer's, TRL's reference model's...)."""
    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return []
    # type(o), not isinstance(o, ...): isinstance reads o.__class__, which runs the object's own __getattribute__
    # (torch.distributed.reduce_op's warns that it is deprecated)
    return [o for o in gc.get_objects() if issubclass(type(o), engine_module.DeepSpeedEngine)]


def end_distributed() -> None:
    """Wait for every rank, then tear down what a run started, in order: DeepSpeed's engines (their optimizers'
    hooks, handles and pending gathers), DeepSpeed's comm layer with the process groups it holds, and torch's
    default process group.

    Call it last in a distributed script. Left to the interpreter's exit, these are destroyed in whatever order
    finalization reaches them, while a peer may still talk to them, and a rank that finished cleanly can abort
    ("terminate called without an active exception", exit code -6), which the launcher reports as a failed run.
    Once they are torn down, the process exits without the interpreter's final collections
    (:func:`exit_without_final_collections`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    release_deepspeed_shm_names()
    dist.barrier()
    for engine in _deepspeed_engines():
        engine.destroy()
    destroy_process_groups()
    exit_without_final_collections()


def exit_without_final_collections() -> None:
    """At interpreter exit, move every object to the collector's permanent generation (:func:`gc.freeze`), which the
    interpreter's final collections skip.

    A process that imported torch, transformers and DeepSpeed tracks millions of objects, and those collections walk
    them all while the launcher waits for the rank (docs/benchmarks.md, "How long the ranks take to exit"). Only
    :func:`end_distributed` asks for it, after the engines and process groups are torn down in order: a process group
    or engine left to the collector at exit (a script that never called ``end_distributed``) would then never be
    destroyed, and its threads still running when the C++ runtime exits abort the process. What the collections would
    have freed is the process's memory, which the OS takes back; a finalizer (``__del__``) of an object in a reference
    cycle does not run at exit. Runs once per process; nothing changes before the exit.
    """
    global _FREEZE_AT_EXIT
    if not _FREEZE_AT_EXIT:
        atexit.register(gc.freeze)
        _FREEZE_AT_EXIT = True


_FREEZE_AT_EXIT = False


_SHM_RELEASED = False


def _deepspeed_shm_path(rank: int) -> str | None:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (addr and port and hasattr(os, "getuid")):
        return None
    # the name DeepSpeed's CPU shm comm op gives rank ``rank``'s workspace (deepspeed/ops/csrc/cpu/comm/shm.cpp)
    return f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def release_deepspeed_shm_names() -> None:
    """Unlink the shared-memory files DeepSpeed's CPU comm op creates, once every rank has mapped them.

    On CPU, DeepSpeed allocates a ``/dev/shm/deepspeed_allreduce_buffer_*`` workspace per rank and never unlinks it:
    every run leaks them into ``/dev/shm``, which is RAM, and a test suite's many launches add up. Once all ranks have
    opened each other's workspaces the names are no longer needed; unlinking them keeps the mappings valid and lets
    the kernel free the memory when the processes exit, however they exit. Collective: call it on every rank.
    """
    global _SHM_RELEASED
    if _SHM_RELEASED:
        return
    from deepspeed.comm import comm as ds_comm  # noqa: PLC0415 (slow, probes the accelerator: only where an engine runs)

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
