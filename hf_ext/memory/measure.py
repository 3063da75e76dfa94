"""Measured memory: this process's resident set (current and peak, with a resettable peak on Linux), the peak
accelerator memory, and a callback that logs the memory plan at train start and the measured peak beside it at the
end.

On CPU the number that decides whether a run fits is the resident set size (RSS): Linux keeps its high-water mark
(``VmHWM``) and lets a process reset it (``/proc/self/clear_refs``), so a peak can be measured over one phase
(training) without the model loading or the planner's own probe counting.
"""

from __future__ import annotations

import logging
import re
import resource
import sys
from pathlib import Path

import psutil
import torch
from transformers import TrainerCallback
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from ..gather import is_sharded
from ..sizes import GiB, gb
from .formulas import model_state_bytes

logger = logging.getLogger(__name__)

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def current_rss() -> int:
    """Resident set size of this process, in bytes."""
    value = _status_kib("VmRSS")
    if value is not None:
        return value
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """Peak resident set size of this process since start (or since :func:`reset_peak_rss`), in bytes."""
    value = _status_kib("VmHWM")
    if value is not None:
        return value
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Restart the peak RSS measurement at the current RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def accelerator_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def in_use() -> int:
    """Bytes in use now: accelerator memory allocated on GPUs, resident set size on CPU."""
    return torch.cuda.memory_allocated() if accelerator_in_use() else current_rss()


def measured_peak() -> int:
    """Peak bytes of this process (since its owner last reset the counter): accelerator memory on GPUs, resident set
    size on CPU."""
    if accelerator_in_use():
        return torch.cuda.max_memory_allocated()
    return peak_rss()


class MemoryPlanCallback(TrainerCallback):
    """Logs the memory plan (prediction per component) at train start and the measured per-rank peak at train end.

    The peak is the process's own high-water mark (resident set size on CPU, peak allocated accelerator memory on
    GPUs), read and never reset: the process's counters stay its owner's. When training raised it, the peak is
    training's and is compared with the plan's total above the memory in use at train start; when an earlier phase
    (model loading) peaked higher, training's peak is only known to lie below it, and the line says so. Results are
    kept in ``self.result``, and ``memory_peak_gib`` / ``memory_predicted_gib`` join the train summary in
    ``state.log_history``. Usable with the stock :class:`transformers.Trainer` too: pass ``MemoryPlanCallback(plan)``,
    or with no plan to only measure.
    """

    def __init__(self, plan=None):
        self.plan = plan
        self.baseline = 0
        self.peak_at_start = 0
        self.result: dict = {}

    def on_train_begin(self, args, state, control, **kwargs):
        if self.plan is None:
            self.plan = getattr(args, "memory_plan", None)
        if self.plan is not None and state.is_world_process_zero:
            logger.info("Memory plan (per rank):\n" + self.plan.describe())
        self.peak_at_start, self.baseline = measured_peak(), in_use()

    def on_train_end(self, args, state, control, **kwargs):
        peak = measured_peak()
        raised = peak > self.peak_at_start
        self.result = {
            "peak_bytes": peak,
            "baseline_bytes": self.baseline,
            "increment_bytes": peak - self.baseline,
            "peak_during_training": raised,
        }
        during = "" if raised else f"at most; the peak of {gb(peak)} was reached before training, "
        line = f"Measured peak memory on rank {args.process_index}: {gb(peak)} ({during}{gb(peak - self.baseline)} "
        line += f"above the {gb(self.baseline)} in use at train start)"
        if self.plan is not None:
            predicted = self.plan.total_bytes
            self.result["predicted_bytes"] = predicted
            line += f"; planned {gb(predicted)} for model states + activations + buffers"
            self.result["ratio"] = (peak - self.baseline) / predicted if predicted and raised else None
        logger.info(line)
        if state.log_history is not None:
            entry = {"memory_peak_gib": round(peak / GiB, 4)}
            if self.plan is not None:
                entry["memory_predicted_gib"] = round(self.plan.total_bytes / GiB, 4)
            # into the train summary stock logged just before on_train_end: log_history[-1] stays that summary
            summary = state.log_history[-1] if state.log_history else None
            if summary is not None and "train_runtime" in summary:
                summary.update(entry)
            else:
                state.log_history.append({**entry, "step": state.global_step})


def loaded_whole_under_zero3(model, world_size: int, local_ranks: int) -> str | None:
    """Under ZeRO-3, the line that says ``model`` was loaded whole on every rank, or ``None``.

    ZeRO-3 partitions the parameters as ``from_pretrained`` creates them (``zero.Init``) only when the DeepSpeed config
    exists by then: ``TrainingArguments(deepspeed=...)`` created first. Created after, every rank of a node holds the
    whole model in host RAM until the engine partitions it. The figures are the planner's ZeRO-3 parameter bytes
    (:func:`hf_ext.memory.formulas.model_state_bytes`) for one whole copy and for one partition, times the ranks of the
    node."""
    params = list(model.parameters()) if model is not None else []
    if not is_deepspeed_zero3_enabled() or not params or any(is_sharded(p) for p in params):
        return None
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(params[0].dtype, "fp32")
    count = sum(p.numel() for p in params)
    whole = model_state_bytes(count, 0, world_size, precision).params
    part = model_state_bytes(count, 3, world_size, precision).params
    return (
        f"ZeRO-3: {type(model).__name__} was loaded whole on every rank ({local_ranks} x {gb(whole)} = "
        f"{gb(local_ranks * whole)} of host RAM on this node), because the TrainingArguments were created after "
        f"from_pretrained; created first, zero.Init partitions it as it loads ({local_ranks} x {gb(part)} = "
        f"{gb(local_ranks * part)}). Fix: create the TrainingArguments (deepspeed=...) before from_pretrained."
    )
