"""Generation eval under ZeRO-3 with the weights gathered once per evaluation, not at every decoding step.

Under ZeRO-3 each rank holds a slice of every parameter; ``generate()`` on the partitioned module all-gathers every
layer again at every decoding step (with ``synced_gpus`` so that the ranks stay in step). When the full model fits on
each rank beside the training state, :func:`gathered_copy` builds a plain copy of it instead: the parameters are
gathered group by group (DeepSpeed's ``GatheredParameters``, read-only: nothing is written back) into a model built
on the meta device, so that generation then runs on local weights with no collective per token. The copy is freed
when the evaluation ends and the partitioned parameters are never touched, so training continues exactly as it would
have.

:func:`choose_generation_path` decides, and says why in one line: the plan of the run when the memory planner made
one (its ``gathered_eval_bytes`` beside the training state in the budget), else the memory free now on this rank.
"""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import gather
from ..memory.formulas import GATHERED_EVAL_HEADROOM
from ..runtime import host_memory_per_rank, trim_heap
from ..sizes import gb

logger = logging.getLogger(__name__)

#: Parameters gathered at a time while the copy is filled (bytes): bounds the transient beside the copy.
GROUP_BYTES = 256 * 2**20


def is_partitioned_model(model) -> bool:
    """True when ``model``'s parameters are ZeRO-3 partitions."""
    return any(gather.is_partitioned(p) for p in model.parameters())


def _unique_parameters(model) -> list[torch.nn.Parameter]:
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def full_parameter_bytes(model) -> int:
    """Bytes of every parameter of ``model`` at full size in its stored dtype (what a gathered copy holds)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in _unique_parameters(model))


@dataclass
class GenerationPath:
    gathered: bool
    reason: str

    @property
    def name(self) -> str:
        return "gathered once" if self.gathered else "per-token gathers"


def _free_bytes(device: torch.device, local_ranks: int) -> tuple[int, str]:
    """Memory this rank may still take: free accelerator memory, or on CPU the host's available RAM shared by its
    ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    return host_memory_per_rank(local_ranks), f"host RAM available / {local_ranks} local ranks"


def choose_generation_path(model, setting: str, plan=None, device=None, local_ranks: int = 1) -> GenerationPath:
    """Gather once or gather per token: ``setting`` is ``"auto"``, ``"true"`` or ``"false"``
    (``generation_gather_weights``)."""
    if setting == "false":
        return GenerationPath(False, "generation_gather_weights=false")
    if not hasattr(model, "config") or not hasattr(type(model), "from_pretrained"):
        return GenerationPath(False, f"{type(model).__name__} is not a plain transformers model (PEFT-wrapped?)")
    need = full_parameter_bytes(model)
    if setting == "true":
        return GenerationPath(True, f"generation_gather_weights=true ({gb(need)} per rank)")
    if plan is not None and plan.budget is not None and plan.gathered_eval_bytes:
        room = plan.budget - plan.eval_state_bytes
        if plan.gathered_eval_fits:
            return GenerationPath(
                True, f"the plan has room: {gb(plan.gathered_eval_bytes)} of {gb(room)} beside the training state"
            )
        return GenerationPath(
            False,
            f"the plan has no room: {gb(plan.gathered_eval_bytes)} needed, {gb(room)} free beside the training state",
        )
    device = torch.device(device) if device is not None else next(model.parameters()).device
    free, where = _free_bytes(device, local_ranks)
    wanted = int(need * (1 + GATHERED_EVAL_HEADROOM))
    if wanted <= free:
        return GenerationPath(True, f"{gb(wanted)} needed, {gb(free)} {where}")
    return GenerationPath(False, f"{gb(wanted)} needed but only {gb(free)} {where}")


@contextmanager
def gathered_copy(model, group_bytes: int = GROUP_BYTES):
    """A plain, unpartitioned copy of the ZeRO-3 ``model`` on this rank (in eval mode), freed on the way out.

    Collective: every rank must enter it. The copy is built on the meta device (no memory, no initialisation), then
    each parameter is replaced by its gathered full tensor, ``group_bytes`` at a time; tied parameters stay tied.
    The copy keeps the very tensors the gather produced (no second copy): leaving ``GatheredParameters`` only drops
    DeepSpeed's reference to them (``free_param`` rebinds ``param.data``), and nothing writes to weights during an
    evaluation. Buffers are not partitioned by ZeRO-3 and are shared as they are.
    """
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.generation_config = model.generation_config
    params = _unique_parameters(model)
    clones: dict[int, torch.nn.Parameter] = {}
    group, size = [], 0
    for i, param in enumerate(params):
        group.append(param)
        size += getattr(param, "ds_numel", param.numel()) * param.element_size()
        if size >= group_bytes or i == len(params) - 1:
            with gather.gathered(group):
                for p in group:
                    clones[id(p)] = torch.nn.Parameter(p.data.detach(), requires_grad=False)
            group, size = [], 0
    targets = dict(copy.named_modules())
    for name, module in model.named_modules():
        target = targets[name]
        for key, param in module._parameters.items():
            if param is not None:
                target._parameters[key] = clones[id(param)]
        for key, buffer in module._buffers.items():
            if buffer is not None:
                target._buffers[key] = buffer.detach()
    del clones
    copy.eval()
    try:
        yield copy
    finally:
        del copy, targets
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        trim_heap()
