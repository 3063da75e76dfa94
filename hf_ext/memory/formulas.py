"""Memory planner: per-rank peak memory for each ZeRO stage / offload / micro-batch, and the choice of the least
sharded configuration that fits.

Per-rank peak = **model states** + **DeepSpeed buffers** + **activations** (forward + backward) + the
**optimizer-step transient**, plus a measured **runtime overhead** (trainer, engine, communication) on CPU. All in
bytes. Activations are freed before the optimizer step, so for DDP and ZeRO-1/2/3 the larger of activations and step
transient counts, not their sum; for DDP (without gradient accumulation) the Trainer also frees the gradients before
each forward, so activations take turns with gradients + step transient, and ZeRO-2's gradient partition and
ZeRO-1/2's fp32 copy of it exist only from backward's reductions to the step (:attr:`Plan.gradient_partition_turns`).
ZeRO-3's gathers and releases run inside forward and backward: the gathered parameters are a buffer, beside the
activations. ZeRO-0 flattens the gradients while backward runs: there activations and step transient add up.

Model states, Adam, Ψ parameters (Ψ_t trainable), N ranks, partitions of ``ceil(Ψ/N)`` elements:

=====================  ================  ===============  ==================
stage                  params            grads            optimizer states
=====================  ================  ===============  ==================
0 (DDP / no ZeRO)      p·Ψ               p·Ψ_t            o·Ψ_t
1                      p·Ψ               p·Ψ_t            o·⌈Ψ_t/N⌉
2                      p·Ψ               p·⌈Ψ_t/N⌉        o·⌈Ψ_t/N⌉
3                      p·⌈Ψ/N⌉           p·⌈Ψ_t/N⌉        o·⌈Ψ_t/N⌉
=====================  ================  ===============  ==================

p = 4 bytes in fp32 (CPU), 2 with fp16/bf16; o = 8 (Adam m, v) in fp32, 12 (fp32 master + m + v) with fp16/bf16 —
so 16Ψ for DDP in both, 4Ψ + 12Ψ/N for ZeRO-1 in mixed precision, 2Ψ + 14Ψ/N for ZeRO-2, 16Ψ/N for ZeRO-3.
``offload_optimizer`` moves the optimizer states to the host, and with them the fp32 gradient partition the
optimizer reads (4·⌈Ψ_t/N⌉; at stage ≥ 2 the device then keeps no gradient partition); at stage 3 DeepSpeed also keeps
its gradient-accumulation partition (``grad_partitions_flat_buffer``, in the model's dtype, p·⌈Ψ_t/N⌉) on the host,
beside that fp32 copy. ``offload_param`` (stage 3) moves the parameter partition. On a CPU-only host, device and host
are the same RAM: offload saves nothing, and at stage 3 it costs the second gradient partition.

Buffers (what DeepSpeed allocates beyond those formulas, read from ``stage_1_and_2.py`` / ``stage3.py``): the fp32
master copy of the partition when training in fp32 (``.clone()`` of a tensor already fp32: 4·⌈Ψ_t/N⌉), the
gradient-reduction buckets (``reduce_bucket_size`` elements, twice with ``overlap_comm``), ZeRO-3's
parameters gathered for compute (persistent small ones, and live gathered ones up to
``stage3_max_live_parameters``); DDP's gradient buckets (one more copy of the gradients).

FSDP2 full shard (:data:`FSDP_FULL_SHARD`) keeps 16Ψ/N in fp32 and under mixed precision alike (the sharded
parameters are fp32 and serve as master weights, the compute copy exists only while a block is gathered), plus the
gathered blocks and their whole gradients (:func:`buffer_bytes`); no separate master copy, unlike DeepSpeed in fp32.

Activations come from a probe: one forward + backward of the real model at micro-batch 1 and 2 and the planned
sequence length (with activation checkpointing on or off), the peak allocated bytes of that pass recorded by the
torch profiler; linear in the micro-batch between and beyond. Measured in fp32 and halved for fp16/bf16.

Error band: :data:`ERROR_BAND` (relative) plus :data:`ERROR_FLOOR` (absolute, allocator slack), stated with each plan.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

from ..model_info import hidden_size_buckets
from ..sizes import GiB, MiB, gb

logger = logging.getLogger(__name__)

#: stated accuracy of a plan's per-rank total: within ERROR_BAND of the prediction, plus ERROR_FLOOR bytes
ERROR_BAND = 0.15
ERROR_FLOOR = 64 * MiB

#: Room kept beside a gathered copy of the weights for generation itself (activations, the beams' caches), as a
#: share of the copy.
GATHERED_EVAL_HEADROOM = 0.25

#: ZeRO-3 granularity of hf-ext's presets on a CPU-only host (elements): the size of one optimizer-step sub-group
#: and the most gathered parameters kept alive. The GPU values (1e9, transformers' documented ones) keep the whole
#: model gathered between uses and step the optimizer over the whole partition at once, which on CPU costs up to the
#: full model plus two partition-sized temporaries of RAM per rank (docs/benchmarks.md, "Memory").
CPU_ZERO3_GRANULARITY = 10_000_000
CPU_ZERO3_KEYS = ("sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance")

PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}  # Adam m + v (+ fp32 master under mixed precision)
FP32 = 4
#: per-rank runtime overhead above the process baseline with a near-empty model (Trainer, accelerate, the engine,
#: communication, data loading), calibrated on CPU with 2 gloo ranks against the measured peaks of tests/distributed
#: and docs/benchmarks.md ("Planner calibration" says how each value was set).
RUNTIME_OVERHEAD = {"ddp": 85 * MiB, 0: 20 * MiB, 1: 95 * MiB, 2: 95 * MiB, 3: 120 * MiB, "fsdp": 85 * MiB}
GPU_RESERVE = 1 * GiB  # CUDA context + allocator fragmentation


@dataclass(frozen=True)
class Candidate:
    """One way to train: ZeRO ``stage`` (0-3; ``ddp`` True for plain DistributedDataParallel, ``fsdp`` True for
    FSDP2 full shard) and offloads."""

    stage: int
    offload_optimizer: bool = False
    offload_param: bool = False
    ddp: bool = False
    fsdp: bool = False

    @property
    def name(self) -> str:
        if self.ddp:
            return "DDP"
        if self.fsdp:
            return "FSDP full shard"
        name = f"ZeRO-{self.stage}"
        offloads = [n for n, on in (("optimizer", self.offload_optimizer), ("param", self.offload_param)) if on]
        return name + (f" + offload {'+'.join(offloads)}" if offloads else "")

    def sharding_rank(self) -> tuple:
        """Orders candidates from least to most sharded (the planner prefers the first that fits)."""
        return (self.stage, self.offload_optimizer, self.offload_param, self.fsdp)


#: FSDP2 with every parameter, gradient and optimizer state split over the ranks (``fsdp="full_shard"``); its
#: ``no_shard`` is DDP
FSDP_FULL_SHARD = Candidate(3, fsdp=True)

#: the engines ``hf-ext ds plan`` chooses among for a micro-batch (docs/memory.md, "Which engine?"), least sharded first:
#: DDP, ZeRO-1, ZeRO-2 (+ offload on GPU hosts), ZeRO-3, FSDP full shard, ZeRO-3 + offloads
ENGINES = (
    Candidate(0, ddp=True),
    Candidate(1),
    Candidate(2),
    Candidate(2, offload_optimizer=True),
    Candidate(3),
    FSDP_FULL_SHARD,
    Candidate(3, offload_optimizer=True),
    Candidate(3, offload_optimizer=True, offload_param=True),
)

#: the candidates ``"auto"`` chooses among (DeepSpeed configs), least sharded first, in the order of
#: :meth:`Candidate.sharding_rank` (transformers' DeepSpeed guide ranks them so by speed: 0, 1, 2, 2 + offload, 3, 3 +
#: offload)
CANDIDATES = (
    Candidate(0),
    Candidate(1),
    Candidate(2),
    Candidate(2, offload_optimizer=True),
    Candidate(3),
    Candidate(3, offload_optimizer=True),
    Candidate(3, offload_optimizer=True, offload_param=True),
)


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer states per rank, on the device and offloaded to the host."""

    params: int
    grads: int
    optimizer: int
    host_params: int = 0
    host_grads: int = 0
    host_optimizer: int = 0

    @property
    def device(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def host(self) -> int:
        return self.host_params + self.host_grads + self.host_optimizer

    @property
    def total(self) -> int:
        return self.device + self.host


def model_state_bytes(
    num_params: int,
    stage: int,
    world_size: int,
    precision: str = "fp32",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    trainable: int | None = None,
) -> ModelStates:
    """Model-state bytes per rank by the ZeRO formulas (see the module docstring) for Adam-type optimizers."""
    if precision not in PARAM_BYTES:
        raise ValueError(f"precision must be one of {', '.join(PARAM_BYTES)}, got {precision!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3")
    n = max(1, int(world_size))
    t = num_params if trainable is None else trainable
    p, o = PARAM_BYTES[precision], OPTIMIZER_BYTES[precision]
    part, t_part = math.ceil(num_params / n), math.ceil(t / n)
    params = p * (part if stage == 3 else num_params)
    grads = p * (t_part if stage >= 2 else t)
    optimizer = o * (t_part if stage >= 1 else t)
    host_params = host_grads = host_optimizer = 0
    if offload_optimizer:
        host_optimizer, optimizer = optimizer, 0
        host_grads = FP32 * t_part
        if stage >= 2:
            grads = 0
        if stage == 3:  # the gradient-accumulation partition stays too, on the host (stage3.py, self.device = cpu)
            host_grads += p * t_part
    if offload_param:
        host_params, params = params, 0
    return ModelStates(params, grads, optimizer, host_params, host_grads, host_optimizer)


# --- activations ------------------------------------------------------------------------------------------------


@dataclass
class ActivationProfile:
    """Peak bytes of a forward + backward pass above the model states, as a line in the micro-batch."""

    seq_len: int
    checkpointing: bool
    points: list[tuple[int, int]]  # (micro-batch, measured bytes) in fp32
    fixed: float = 0.0
    per_sample: float = 0.0

    def __post_init__(self):
        (b1, a1), (b2, a2) = self.points[0], self.points[-1]
        self.per_sample = max(0.0, (a2 - a1) / (b2 - b1)) if b2 != b1 else a1 / max(1, b1)
        self.fixed = max(0.0, a1 - self.per_sample * b1)

    def at(self, batch: int, precision: str = "fp32") -> int:
        scale = PARAM_BYTES[precision] / FP32
        return int((self.fixed + self.per_sample * batch) * scale)


# --- buffers, transients, the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs to know about a model (from :func:`model_facts`)."""

    num_params: int
    trainable: int
    hidden_size: int | None
    persistent_params: int  # elements in parameters below ZeRO-3's persistence threshold (10 x hidden)
    largest_param: int
    checkpoint_bytes: int = 0  # bytes of the weight files from_pretrained maps (0: trained from scratch)
    largest_block: int = 0  # parameters of the largest repeated layer (FSDP's wrapping unit); 0: unknown
    block_params: int = 0  # parameters inside all those blocks (the rest is FSDP's root group)


def zero_settings(zero: dict | None, hidden: int | None) -> dict:
    """The bucket / gathering sizes DeepSpeed will use: explicit values, else hf-ext's / DeepSpeed's defaults."""
    zero = zero or {}
    buckets = {key: value for key, (value, _) in hidden_size_buckets(hidden).items()} if hidden else {}

    def value(key, default):
        v = zero.get(key, default)
        return default if not isinstance(v, (int, float)) or isinstance(v, bool) else int(v)

    return {
        "reduce_bucket_size": value("reduce_bucket_size", buckets.get("reduce_bucket_size", 500_000_000)),
        "overlap_comm": bool(zero.get("overlap_comm", False) is True),
        "contiguous_gradients": zero.get("contiguous_gradients", True) is not False,
        "stage3_max_live_parameters": value("stage3_max_live_parameters", 1_000_000_000),
        "sub_group_size": value("sub_group_size", 1_000_000_000),
        "stage3_prefetch_bucket_size": value(
            "stage3_prefetch_bucket_size", buckets.get("stage3_prefetch_bucket_size", 50_000_000)
        ),
    }


def buffer_bytes(candidate: Candidate, facts: ModelFacts, world_size: int, precision: str, zero: dict | None) -> dict:
    """DeepSpeed's (or DDP's) memory beyond the model-state formulas, per rank, by name."""
    n, p = max(1, world_size), PARAM_BYTES[precision]
    t_part = math.ceil(facts.trainable / n)
    out: dict[str, int] = {}
    if candidate.ddp:
        out["ddp_gradient_buckets"] = p * facts.trainable
        return out
    if candidate.fsdp:
        # FSDP2 all-gathers one block at a time in the compute dtype (plus the next one, prefetched), and the root
        # group (embeddings, final norm, LM head: what no block holds) for the whole forward and backward; a block's
        # gradients exist whole until they are reduce-scattered, in the compute dtype too (accelerate's mixed
        # precision policy reduces in its param dtype). Each collective stages its group once more in a flat buffer
        # (the all-gather's output before it is copied out, the reduce-scatter's input).
        block = facts.largest_block or facts.largest_param
        root = facts.num_params - facts.block_params if facts.block_params else facts.largest_param
        out["gathered_blocks"] = p * (root + 3 * block)
        out["unsharded_gradients"] = p * (root + 2 * block)
        return out
    s = zero_settings(zero, facts.hidden_size)
    if candidate.stage >= 1 and precision == "fp32":
        out["fp32_master_copy"] = FP32 * t_part
    if candidate.stage in (1, 2) and (precision == "fp32" or not candidate.offload_optimizer):
        # the reduced gradient partition, flattened and cast to fp32 for the fp32 master partition's optimizer (kept
        # twice in fp32 runs; with offload under mixed precision it is the host's fp32 gradients, counted there)
        out["fp32_gradient_partition_copy"] = FP32 * t_part
    if candidate.stage in (1, 2) and s["contiguous_gradients"]:
        out["reduce_buckets"] = min(s["reduce_bucket_size"], facts.trainable) * p * (2 if s["overlap_comm"] else 1)
    if candidate.stage == 3:
        out["reduce_buckets"] = min(s["reduce_bucket_size"], facts.trainable) * p
        out["persistent_params"] = p * facts.persistent_params
        live = min(s["stage3_max_live_parameters"], facts.num_params - facts.persistent_params)
        out["gathered_params"] = p * max(live, facts.largest_param)
    return out


def largest_sub_group(facts: ModelFacts, world_size: int, sub_group_size: int = 10**9) -> int:
    """Elements of the largest sub-group ZeRO-3 steps the optimizer on: DeepSpeed fills a sub-group with parameter
    partitions until it holds ``sub_group_size`` elements or more (``_create_fp16_sub_groups``), so one holds at most
    ``sub_group_size - 1`` elements plus the largest parameter partition — and never more than the rank's partition."""
    n = max(1, world_size)
    partition = math.ceil(facts.trainable / n)
    return min(partition, max(1, sub_group_size) - 1 + math.ceil(facts.largest_param / n))


def step_transient_bytes(
    candidate: Candidate, facts: ModelFacts, world_size: int, device: str = "cpu", sub_group_size: int = 10**9
) -> int:
    """Temporaries after the backward pass: the optimizer's ``sqrt(v)`` (torch AdamW runs per tensor on CPU, on a
    whole tensor list on GPUs) and DeepSpeed's flattened fp32 gradients — of the rank's partition (ZeRO 1-3) or of
    all gradients for the all-reduce (ZeRO-0).

    ZeRO-3 steps one sub-group at a time (:func:`largest_sub_group`): torch AdamW's ``exp_avg_sq.sqrt()`` and its
    quotient, 2 x 4 bytes of the sub-group. With ``offload_optimizer`` that step runs on the host (hf-ext's presets
    use torch AdamW, ``torch_adam``), so it counts where the host is the device's RAM (CPU-only host) and is 0 on
    accelerators. The offloaded path's other temporary, the fp64 norm of each gradient partition at the accumulation
    boundary (``_constant_buffered_norm2``: 8 bytes x the largest parameter partition), is never larger: a sub-group
    holds at least that partition (docs/benchmarks.md, "Planner calibration")."""
    n = max(1, world_size)
    if candidate.fsdp:  # torch AdamW steps each local shard on its own: sqrt(v) and the quotient of the largest
        return 2 * FP32 * math.ceil(facts.largest_param / n)
    if candidate.offload_optimizer:
        if device != "cpu" or candidate.stage != 3:
            return 0
        return 2 * FP32 * largest_sub_group(facts, n, sub_group_size)
    per_tensor = FP32 * (facts.largest_param if device == "cpu" else facts.trainable)
    if candidate.ddp:
        return per_tensor
    if candidate.stage == 0:
        return FP32 * facts.trainable + per_tensor
    partition = math.ceil(facts.trainable / n)
    if candidate.stage == 3:  # ZeRO-3 steps the optimizer one sub-group of the partition at a time
        return 2 * FP32 * largest_sub_group(facts, n, sub_group_size)
    # ZeRO-1/2: torch AdamW's sqrt(v) of the one flat partition on CPU (with from_pretrained the file's pages come on
    # top, see checkpoint_pages_bytes); on accelerators also the flattened gradient beside it
    return (1 if device == "cpu" else 2) * FP32 * partition


def checkpoint_pages_bytes(candidate: Candidate, facts: ModelFacts, world_size: int, device: str = "cpu") -> int:
    """Pages of the weight files that stay in the process's resident set on a CPU host.

    ``from_pretrained`` memory-maps the safetensors files and the parameters start as views of them. DeepSpeed
    ZeRO-1/2 copies every parameter into its flat buffer (reading all pages), FSDP2 copies each rank's shard of every
    parameter (1/N of the pages), and the mapping stays (``benchmarks.bench_mapped_pages``: the whole file's pages stay
    resident beside the copy; docs/benchmarks.md, "Engines × precision"). Those pages are clean page cache the
    kernel could take back under memory pressure; without it they stay beside the activations too (the 400M shape's
    ZeRO-2 micro-batches 12-18: the states, the pages and the activations). DDP trains on the mapped pages themselves
    (its parameters); ZeRO-3 partitions while loading."""
    if device != "cpu" or not facts.checkpoint_bytes or candidate.ddp or candidate.offload_param:
        return 0
    if candidate.fsdp:
        return math.ceil(facts.checkpoint_bytes / max(1, world_size))
    return facts.checkpoint_bytes if candidate.stage in (1, 2) else 0


@dataclass
class Plan:
    """Predicted per-rank peak memory of one candidate at one micro-batch, by component (bytes)."""

    candidate: Candidate
    world_size: int
    micro_batch: int
    seq_len: int
    precision: str
    checkpointing: bool
    states: ModelStates
    buffers: dict
    activations: int
    step_transient: int
    overhead: int
    offload_counts: bool  # True when offloaded bytes use the same memory as the device (CPU-only host)
    budget: int | None = None
    baseline: int = 0  # the process's own memory before the model exists (RSS on CPU, a reserve on GPUs)
    notes: list[str] = field(default_factory=list)
    accumulation_steps: int = 1
    checkpoint_pages: int = 0  # see checkpoint_pages_bytes: resident throughout

    @property
    def device_bytes(self) -> int:
        buffers = sum(self.buffers.values())
        # the weight file's pages stay mapped beside everything (the kernel keeps them while memory is not short)
        pages = self.checkpoint_pages
        if self.candidate.ddp and self.accumulation_steps == 1:
            # the Trainer frees the gradients (set_to_none) before each forward, so the activations grow into the
            # room the gradients take in backward
            rest = max(self.activations, self.states.grads + self.step_transient)
            return self.states.params + self.states.optimizer + buffers + pages + rest
        if self.candidate.ddp or self.candidate.stage == 3 or self.candidate.fsdp:
            # DDP with gradient accumulation (the next forward runs beside the gradients); ZeRO-3 steps its
            # sub-groups after backward's epilogue, when the activations are gone; FSDP2 likewise
            return self.states.device + buffers + pages + max(self.activations, self.step_transient)
        if self.candidate.stage in (1, 2):
            turns = self.gradient_partition_turns
            return self.states.device + buffers + pages - turns + max(self.activations, turns + self.step_transient)
        # ZeRO-0: DeepSpeed's flattened gradients sit on top of the activation peak (its hooks reduce while
        # backward still runs)
        return self.states.device + buffers + pages + self.activations + self.step_transient

    @property
    def gradient_partition_turns(self) -> int:
        """ZeRO-1/2's gradient memory that takes turns with the activations instead of adding to them.

        ZeRO-2 reduces into its gradient partition (``grads_in_partition``) during backward, flattens it at
        backward's epilogue and releases it after the step (``_release_ipg_buffers``); the optimizer's fp32 copy of
        the flat partition exists in the step only (``stage_1_and_2.py``). Measured at the DeBERTa-v3-large shape
        (2 CPU ranks, fp32, micro-batches 5 and 8 x 128 tokens): the peak is the states plus the activations,
        without the partition or its copy; at small micro-batches the states plus those and the step's temporary.
        With gradient accumulation the partition stays between micro-batches (beside the next forward)."""
        if self.candidate.ddp or self.candidate.fsdp or self.candidate.stage not in (1, 2):
            return 0
        turns = self.buffers.get("fp32_gradient_partition_copy", 0)
        if self.candidate.stage == 2 and self.accumulation_steps == 1:
            turns += self.states.grads
        return turns

    @property
    def total_bytes(self) -> int:
        """Predicted peak per rank above the process baseline (what must fit in ``budget``)."""
        return self.device_bytes + (self.states.host if self.offload_counts else 0) + self.overhead

    @property
    def eval_state_bytes(self) -> int:
        """What stays allocated per rank between training steps (during an evaluation): the model states and
        DeepSpeed's buffers, not the activations or the step's temporaries."""
        host = self.states.host if self.offload_counts else 0
        return self.baseline + self.states.device + sum(self.buffers.values()) + host + self.overhead

    @property
    def gathered_eval_bytes(self) -> int:
        """The extra peak per rank of a generation eval with the weights gathered once (hf_ext.evaluation.gathered):
        a full copy of the parameters and room for generation beside it. 0 below ZeRO-3 (the weights are whole)."""
        if self.candidate.ddp or self.candidate.fsdp or self.candidate.stage < 3:
            return 0  # FSDP generates on the sharded model (hf_ext.evaluation.gathered is ZeRO-3's)
        full = (self.states.params + self.states.host_params) * self.world_size
        return int(full * (1 + GATHERED_EVAL_HEADROOM))

    @property
    def band(self) -> tuple[int, int]:
        """The stated error band: [total x (1 - ERROR_BAND) - ERROR_FLOOR, total x (1 + ERROR_BAND) + ERROR_FLOOR]."""
        total = self.total_bytes
        return max(0, int(total * (1 - ERROR_BAND) - ERROR_FLOOR)), int(total * (1 + ERROR_BAND) + ERROR_FLOOR)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.baseline + self.total_bytes <= self.budget

    @property
    def gathered_eval_fits(self) -> bool:
        """Whether a generation eval with the weights gathered once fits the budget beside the training state."""
        return self.budget is None or self.eval_state_bytes + self.gathered_eval_bytes <= self.budget

    def components(self) -> dict[str, int]:
        parts = {
            "params": self.states.params,
            "grads": self.states.grads,
            "optimizer": self.states.optimizer,
            "activations": self.activations,
            "step_transient": self.step_transient,
        }
        if self.checkpoint_pages:
            parts["checkpoint_pages"] = self.checkpoint_pages
        parts.update({f"buffer:{k}": v for k, v in self.buffers.items()})
        if self.states.host:
            parts.update(
                host_params=self.states.host_params,
                host_grads=self.states.host_grads,
                host_optimizer=self.states.host_optimizer,
            )
        parts["runtime_overhead"] = self.overhead
        return parts

    def describe(self) -> str:
        lines = [
            f"{self.candidate.name}, world size {self.world_size}, micro-batch {self.micro_batch} x {self.seq_len} "
            f"tokens, {self.precision}, activation checkpointing {'on' if self.checkpointing else 'off'}"
        ]
        lines += [f"  {name:<28} {gb(value):>12}" for name, value in self.components().items() if value]
        low, high = self.band
        lines.append(f"  {'predicted peak':<28} {gb(self.total_bytes):>12}  band {gb(low)} .. {gb(high)}")
        if self.budget is not None:
            lines.append(f"  {'+ process baseline':<28} {gb(self.baseline):>12}")
            lines.append(f"  {'budget':<28} {gb(self.budget):>12}  {'fits' if self.fits else 'does NOT fit'}")
        if self.gathered_eval_bytes:
            verdict = "" if self.budget is None else ": fits" if self.gathered_eval_fits else ": does NOT fit"
            lines.append(
                f"  {'generation eval, gathered':<28} {gb(self.gathered_eval_bytes):>12}  beside the "
                f"training state{verdict}"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "candidate": asdict(self.candidate),
            "name": self.candidate.name,
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "activation_checkpointing": self.checkpointing,
            "components": self.components(),
            "total_bytes": self.total_bytes,
            "band": list(self.band),
            "budget": self.budget,
            "baseline": self.baseline,
            "fits": self.fits,
            "gathered_eval_bytes": self.gathered_eval_bytes,
            "gathered_eval_fits": self.gathered_eval_fits,
        }


def plan(
    candidate: Candidate,
    facts: ModelFacts,
    activations: ActivationProfile,
    world_size: int,
    micro_batch: int,
    precision: str = "fp32",
    zero: dict | None = None,
    device: str = "cpu",
    budget: int | None = None,
    baseline: int = 0,
    accumulation_steps: int = 1,
) -> Plan:
    """The predicted per-rank peak of ``candidate`` at ``micro_batch`` (see the module docstring)."""
    if candidate.fsdp:  # sharded fp32 parameters (the master weights under mixed precision), gradients, Adam m + v
        states = model_state_bytes(facts.num_params, 3, world_size, "fp32", trainable=facts.trainable)
    elif candidate.ddp:  # mixed precision without DeepSpeed is autocast: parameters, gradients and buckets stay fp32
        states = model_state_bytes(facts.num_params, 0, world_size, "fp32", trainable=facts.trainable)
    else:
        states = model_state_bytes(
            facts.num_params,
            candidate.stage,
            world_size,
            precision,
            candidate.offload_optimizer,
            candidate.offload_param,
            facts.trainable,
        )
    notes = []
    if device == "cpu" and (candidate.offload_optimizer or candidate.offload_param):
        notes.append("on a CPU-only host offloaded states stay in the same RAM")
    return Plan(
        candidate=candidate,
        world_size=world_size,
        micro_batch=micro_batch,
        seq_len=activations.seq_len,
        precision=precision,
        checkpointing=activations.checkpointing,
        states=states,
        buffers=buffer_bytes(candidate, facts, world_size, "fp32" if candidate.ddp else precision, zero),
        activations=activations.at(micro_batch, precision),
        step_transient=step_transient_bytes(
            candidate, facts, world_size, device, zero_settings(zero, facts.hidden_size)["sub_group_size"]
        ),
        overhead=RUNTIME_OVERHEAD[overhead_key(candidate)] if device == "cpu" else 0,
        offload_counts=device == "cpu",
        budget=budget,
        baseline=baseline,
        notes=notes,
        accumulation_steps=max(1, int(accumulation_steps)),
        checkpoint_pages=checkpoint_pages_bytes(candidate, facts, world_size, device),
    )


def overhead_key(candidate: Candidate):
    return "ddp" if candidate.ddp else "fsdp" if candidate.fsdp else candidate.stage


def max_micro_batch(candidate, facts, activations, world_size, budget, limit: int = 4096, **kwargs) -> int:
    """The largest micro-batch whose plan fits ``budget`` (0 when not even 1 fits)."""
    if not plan(candidate, facts, activations, world_size, 1, budget=budget, **kwargs).fits:
        return 0
    low, high = 1, 2
    while high <= limit and plan(candidate, facts, activations, world_size, high, budget=budget, **kwargs).fits:
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if plan(candidate, facts, activations, world_size, mid, budget=budget, **kwargs).fits:
            low = mid
        else:
            high = mid
    return low


def choose(
    facts: ModelFacts,
    activations: ActivationProfile,
    world_size: int,
    budget: int,
    micro_batch: int | None,
    candidates=CANDIDATES,
    **kwargs,
) -> tuple[Plan | None, list[Plan]]:
    """The least-sharded candidate that fits ``budget`` at ``micro_batch`` — or, with ``micro_batch=None``, the
    candidate allowing the largest micro-batch (ties: the less sharded). Returns (chosen or None, all plans)."""
    device = kwargs.get("device", "cpu")
    if device == "cpu":  # offload saves nothing where device and host are the same RAM
        candidates = [c for c in candidates if not (c.offload_optimizer or c.offload_param)]
    plans = []
    for candidate in candidates:
        batch = micro_batch or max(1, max_micro_batch(candidate, facts, activations, world_size, budget, **kwargs))
        plans.append(plan(candidate, facts, activations, world_size, batch, budget=budget, **kwargs))
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None, plans
    if micro_batch is None:
        return max(fitting, key=lambda p: (p.micro_batch, [-x for x in p.candidate.sharding_rank()])), plans
    return fitting[0], plans
