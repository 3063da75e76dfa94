"""Ray Train as a launcher: every rank's share of a checkpoint reported as one Ray checkpoint, and a restarted (or
resized) worker group resuming from it.

``ray.train.torch.TorchTrainer`` starts one worker per rank, sets the torch.distributed variables and the process
group, and calls a train function on each; on a failure (``FailureConfig(max_failures=...)``) it starts the group
again, with fewer or more workers under ``ScalingConfig(num_workers=(min, max))``, and hands the new workers the last
reported checkpoint (``ray.train.get_checkpoint()``). Ray's own ``RayTrainReportCallback`` has every rank copy and
report the whole checkpoint directory it sees; a DeepSpeed or FSDP checkpoint is written by every rank, each its own
files.

Under Ray, hf-ext's trainers (:mod:`hf_ext.runtime` detects the launcher)

* report each complete ``checkpoint-N`` through :class:`RayCheckpointCallback`: every rank reports the files it wrote
  (its ZeRO partition, its FSDP shard, its RNG state; rank 0 everything else), and Ray merges them into one checkpoint
  in its storage;
* with ``resume_from_checkpoint="last"`` (or ``True``), first put Ray's latest checkpoint into ``output_dir`` when it
  is not there (:func:`restore_latest_checkpoint`), so that the usual resume takes it: on another number of workers
  the ZeRO state is converted and the global batch kept (:mod:`hf_ext.saving.resume`).

:func:`run` starts a function on a ``TorchTrainer`` with the backend and resources for the hardware; recipes take
``--launcher ray --num_workers N`` (or ``MIN:MAX``; :func:`hf_ext.config_args.split_launcher_args`) and run their
``main`` on the workers with :func:`run_script`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import ray
import ray.train
import torch.distributed as dist
from ray.train.torch import TorchConfig, TorchTrainer
from transformers import TrainerCallback

from .atomic import link_or_copy, replace_dir
from .runtime import has_accelerator, local_rank
from .saving import checkpoints

logger = logging.getLogger(__name__)

#: per-rank files of a checkpoint, by the rank in their name: DeepSpeed's ZeRO partitions, torch.distributed.checkpoint
#: shards (FSDP), each rank's RNG state. Every other file is written by the main process (rank 0).
_RANK_FILE = (
    re.compile(r"zero_pp_rank_(\d+)_"),
    re.compile(r"^__(\d+)_\d+\.distcp$"),
    re.compile(r"^rng_state_(\d+)\.pth$"),
)


def rank_of(relative: str | Path) -> int:
    """The rank that writes the checkpoint file ``relative`` (a path inside ``checkpoint-N``)."""
    name = Path(relative).name
    for pattern in _RANK_FILE:
        if match := pattern.search(name):
            return int(match.group(1))
    return 0


def rank_share(checkpoint: Path, rank: int) -> list[Path]:
    """The files of ``checkpoint`` that ``rank`` wrote, relative to it."""
    return [
        p.relative_to(checkpoint)
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and rank_of(p.relative_to(checkpoint)) == rank
    ]


class RayCheckpointCallback(TrainerCallback):
    """After each complete checkpoint: every rank reports its share of it to Ray Train (``ray.train.report`` with the
    same ``checkpoint_dir_name`` on every rank, which Ray merges), with the latest logged metrics."""

    def on_save(self, args, state, control, **kwargs):
        checkpoint = Path(args.output_dir) / f"{checkpoints.CHECKPOINT_PREFIX}-{state.global_step}"
        metrics = {}
        for entry in state.log_history:
            metrics.update(entry)
        metrics["step"] = state.global_step
        # staged beside the checkpoint, on its filesystem: a hard link there never crosses devices (the temporary
        # folder of a cluster's nodes is rarely on the shared storage the output goes to)
        with tempfile.TemporaryDirectory(prefix=".hf-ext-ray-", dir=args.output_dir) as staging:
            for relative in rank_share(checkpoint, args.process_index):
                (Path(staging) / relative).parent.mkdir(parents=True, exist_ok=True)
                link_or_copy(str(checkpoint / relative), str(Path(staging) / relative))  # the checkpoint's own bytes
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(staging), checkpoint_dir_name=checkpoint.name
            )


def restore_latest_checkpoint(output_dir: str | Path) -> Path | None:
    """Ray's latest reported checkpoint as ``output_dir/checkpoint-N`` (copied there by each node's first process
    when it is not there yet, atomically), or ``None`` when Ray has none. Every rank calls it."""
    reported = ray.train.get_checkpoint()
    if reported is None:
        return None
    target = Path(output_dir) / Path(reported.path).name
    if local_rank() in (0, None) and not checkpoints.is_complete_checkpoint(target):
        staging = target.with_name(checkpoints.TMP_PREFIX + target.name)
        shutil.rmtree(staging, ignore_errors=True)
        reported.to_directory(str(staging))
        replace_dir(staging, target)
        logger.info(f"Ray's checkpoint {reported.path} restored as {target}.")
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every node has it before any rank reads it
    return target


def run(
    train_fn,
    config: dict | None = None,
    *,
    num_workers: int | tuple[int, int] = 2,
    max_failures: int = 0,
    use_gpu: bool | None = None,
    name: str | None = None,
    storage_path: str | None = None,
):
    """Run ``train_fn(config)`` on Ray Train workers, one rank each (a ``(min, max)`` range: elastic), gloo on CPU and
    NCCL on GPUs; a failed group is started again up to ``max_failures`` times. Returns Ray's ``Result`` (its
    ``error`` is raised)."""
    use_gpu = has_accelerator() if use_gpu is None else use_gpu
    trainer = TorchTrainer(
        train_fn,
        train_loop_config=config or {},
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=ray.train.RunConfig(
            name=name, storage_path=storage_path, failure_config=ray.train.FailureConfig(max_failures=max_failures)
        ),
    )
    return trainer.fit()


def _script_worker(config: dict) -> None:
    """One Ray Train worker running a script's ``main(argv)`` as one rank, from the driver's working directory (the
    relative paths of its command line); the script's ``__main__`` block does not run: it is the driver's."""
    os.chdir(config["cwd"])
    script = Path(config["script"])
    # imported under a name of its own, registered, so that pickle finds its classes (the saved training arguments)
    spec = importlib.util.spec_from_file_location(f"hf_ext_ray_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.main(config["argv"])


def run_script(script: str | Path, argv: list[str], launch) -> None:
    """Run ``script``'s ``main(argv)`` on Ray Train workers as :func:`run` does, with the settings of
    :func:`hf_ext.config_args.split_launcher_args` (``--num_workers``, ``--max_failures``, ``--ray_storage``)."""
    result = run(
        _script_worker,
        {"script": str(Path(script).resolve()), "argv": list(argv), "cwd": os.getcwd()},
        num_workers=launch.num_workers,
        max_failures=launch.max_failures,
        storage_path=launch.ray_storage,
    )
    logger.info(f"Ray Train run {result.path} ended; its last checkpoint: {result.checkpoint}.")
