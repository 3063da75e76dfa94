"""The model side of the memory plan: parameter counts and an activation probe (one forward + backward of a
random-init copy of the model at micro-batch 1 and 2, peak allocated bytes from the torch profiler)."""

from __future__ import annotations

import copy
import gc
import inspect
import os
import sys
import tempfile
from pathlib import Path

import psutil
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, PretrainedConfig

from ..model_info import (
    hidden_size_buckets,
    hidden_size_of,
    is_sequence_classifier,
    layer_sizes,
    random_init_model,
)
from .formulas import ActivationProfile, ModelFacts


def model_facts(model, checkpoint_bytes: int = 0) -> ModelFacts:
    params = list(model.parameters())
    hidden = hidden_size_of(model)
    threshold = hidden_size_buckets(hidden)["stage3_param_persistence_threshold"][0] if hidden else 0
    blocks = layer_sizes(model)
    return ModelFacts(
        num_params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        hidden_size=hidden,
        persistent_params=sum(p.numel() for p in params if p.numel() < threshold),
        largest_param=max((p.numel() for p in params), default=0),
        checkpoint_bytes=checkpoint_bytes,
        largest_block=max(blocks, default=0),
        block_params=sum(blocks),
    )


def weight_file_bytes(model) -> int:
    """Bytes of the safetensors weight files in ``model`` when it is a local directory (0 otherwise: a config, a hub
    id, or a directory holding only a config, trained from scratch)."""
    if not isinstance(model, (str, Path)) or not Path(model).is_dir():
        return 0
    return sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))


def probe_inputs(model, batch: int, seq_len: int) -> dict:
    """Random inputs of ``batch`` x ``seq_len`` tokens that make any HF LM / seq2seq / classifier compute a loss."""
    config = model.config
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 1000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(4, vocab - 1), vocab, (batch, seq_len), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        inputs["labels"] = torch.randint(min(4, vocab - 1), vocab, (batch, seq_len), generator=g)
    elif is_sequence_classifier(model):
        inputs["labels"] = torch.zeros(batch, dtype=torch.long)
    elif "ForCausalLM" in type(model).__name__ or "LMHead" in type(model).__name__:
        inputs["labels"] = ids.clone()
    return inputs


def peak_live_bytes(events) -> int:
    """Highest running total of ``(time_ns, nbytes)`` allocation events (frees negative), taken in time order (ties
    in the given order), above the level before the first event: the peak of the bytes allocated inside a window and
    still live. Frees of blocks allocated before the window lower the total below 0 and never raise the peak."""
    live = peak = 0
    for _, nbytes in sorted(events, key=lambda event: event[0]):
        live += nbytes
        peak = max(peak, live)
    return peak


#: line prefixes kineto (torch's profiler back end) writes to the process's stderr at every profiler start and stop
KINETO_STDERR_PREFIXES = ("USDT:", "STAGE:")


def _without_kineto_lines(call):
    """Run ``call`` with file descriptor 2 captured, then write back to stderr every captured line that is not one of
    kineto's start/stop lines (C++ writes them, so ``sys.stderr`` redirection does not see them)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            return call()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                if not line.startswith(KINETO_STDERR_PREFIXES)
            ]
            sys.stderr.write("".join(kept))


class PeakTensorBytes:
    """Peak live bytes of the CPU tensors this process allocates inside the block (torch.profiler's memory events):
    a count of allocations, independent of pages and of the allocator's reuse. Bytes that are not tensor storage
    (Python objects, library buffers) are not seen, and a storage that maps a file counts its whole size. ``events``
    keeps the ``(time_ns, nbytes)`` events; ``enabled=False`` measures nothing (``peak`` stays None)."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.peak, self.events = enabled, None, []

    def __enter__(self):
        if self.enabled:
            self.profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            # only the start and stop are captured: what the block writes goes out as it is
            _without_kineto_lines(self.profile.start)
        return self

    def __exit__(self, *exc):
        if not self.enabled:
            return
        _without_kineto_lines(self.profile.stop)
        self.events = [
            (e.start_ns(), e.nbytes())
            for e in self.profile.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type().name == "CPU"
        ]
        self.peak = peak_live_bytes(self.events)


def _peak_allocated(fn) -> int:
    """Peak bytes allocated (above the level at the start) by the CPU allocator while ``fn`` runs."""
    with PeakTensorBytes() as measured:
        fn()
    return measured.peak


def _enable_checkpointing(enable):
    names = inspect.signature(enable).parameters
    kwargs_name = next((n for n in names if n.endswith("checkpointing_kwargs")), None)
    enable(**({kwargs_name: {"use_reentrant": False}} if kwargs_name else {}))


def probe_activations(model, seq_len: int, batches=(1, 2), checkpointing: bool = False) -> ActivationProfile:
    """Measure the activation memory of ``model`` (fp32, on CPU) at each micro-batch in ``batches``.

    Gradients are allocated before the pass (they are model states, counted apart), so the peak is activations,
    their gradients and the transient gradient of one parameter. With ``checkpointing``, the model's activation
    checkpointing is switched on for the probe (non-reentrant) and restored after.
    """
    new_names = hasattr(model, "activation_checkpointing_enable")  # transformers >= 5.23 renamed the switch
    was_ckpt = bool(getattr(model, "is_activation_checkpointing" if new_names else "is_gradient_checkpointing", False))
    enable = model.activation_checkpointing_enable if new_names else model.gradient_checkpointing_enable
    disable = model.activation_checkpointing_disable if new_names else model.gradient_checkpointing_disable
    was_training = model.training
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    if checkpointing and not was_ckpt:
        _enable_checkpointing(enable)
    elif not checkpointing and was_ckpt:
        disable()
    model.train()
    points = []
    try:
        for batch in batches:
            inputs = probe_inputs(model, batch, seq_len)

            def step(inputs=inputs):
                out = model(**inputs)
                loss = out.get("loss") if hasattr(out, "get") else None
                if loss is None:
                    loss = next(v for v in out.values() if torch.is_tensor(v) and v.is_floating_point()).float().sum()
                loss.backward()
                del out, loss

            points.append((batch, _peak_allocated(step)))
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        if checkpointing and not was_ckpt:
            disable()
        elif not checkpointing and was_ckpt:
            _enable_checkpointing(enable)
        model.train(was_training)
    return ActivationProfile(seq_len, checkpointing, points)


#: a whole-model probe holds fp32 weights, their gradients and the activations: above this share of the available
#: memory, the probe runs on 2- and 3-layer copies instead and extrapolates to the model's depth
WHOLE_PROBE_SHARE = 0.25
#: the depths probed instead of the whole model: from the second layer on, each layer adds the same bytes to the peak
#: (a 1-layer model peaks at another point of the backward pass, so it is not used)
PROBED_DEPTHS = (2, 3)
#: config fields that hold a model's depth (an encoder-decoder has two, changed together)
DEPTH_FIELDS = (("encoder_layers", "decoder_layers"), ("num_hidden_layers",))


def depth_fields(config) -> tuple[tuple[str, ...], int] | None:
    """The config fields holding the model's depth and that depth, when every such field holds the same number."""
    for fields in DEPTH_FIELDS:
        values = {getattr(config, name, None) for name in fields}
        if len(values) == 1 and isinstance(depth := values.pop(), int) and depth > PROBED_DEPTHS[-1]:
            return fields, depth
    return None


def extrapolate_depth(two: list[tuple[int, int]], three: list[tuple[int, int]], depth: int) -> list[tuple[int, int]]:
    """Activation bytes of a ``depth``-layer model from 2- and 3-layer measurements at the same micro-batches: the
    layers are identical, so each further layer adds what the third one added."""
    return [(b, a2 + (depth - 2) * max(0, a3 - a2)) for (b, a2), (_, a3) in zip(two, three)]


def _too_large_to_probe_whole(num_params: int) -> bool:
    return 3 * 4 * num_params > WHOLE_PROBE_SHARE * psutil.virtual_memory().available  # fp32 weights, grads, more


def measure(model, seq_len: int, checkpointing: bool) -> dict:
    """Model facts and activation profile of ``model`` (object, config or path) as a JSON-able dict.

    A model object is probed as it is. A config or path is built random-init on the CPU, or, when that copy would
    not fit comfortably (:data:`WHOLE_PROBE_SHARE`), counted on the meta device and probed as 2- and 3-layer copies.
    """
    if hasattr(model, "parameters"):
        facts = model_facts(model, weight_file_bytes(getattr(model, "name_or_path", None)))  # from_pretrained's files
        profile = probe_activations(model, seq_len, (1, 2), checkpointing)
        return {"facts": facts.__dict__, "seq_len": seq_len, "checkpointing": checkpointing, "points": profile.points}
    config = model if isinstance(model, PretrainedConfig) else AutoConfig.from_pretrained(str(model))
    with torch.device("meta"):
        facts = model_facts(random_init_model(config), weight_file_bytes(model))
    depth = depth_fields(config)
    shallow = depth is not None and _too_large_to_probe_whole(facts.num_params)
    shapes = [config]
    if shallow:
        shapes = [copy.deepcopy(config) for _ in PROBED_DEPTHS]
        for shape, layers in zip(shapes, PROBED_DEPTHS):
            for name in depth[0]:
                setattr(shape, name, layers)
    measured = []
    for shape in shapes:
        probe_model = random_init_model(shape)
        measured.append(probe_activations(probe_model, seq_len, (1, 2), checkpointing).points)
        del probe_model
        gc.collect()
    points = extrapolate_depth(*measured, depth[1]) if shallow else measured[0]
    data = {"facts": facts.__dict__, "seq_len": seq_len, "checkpointing": checkpointing, "points": points}
    if shallow:
        data["probed_layers"] = list(PROBED_DEPTHS)
    return data


def from_measurement(data: dict) -> tuple[ModelFacts, ActivationProfile]:
    facts = ModelFacts(**data["facts"])
    points = [tuple(p) for p in data["points"]]
    return facts, ActivationProfile(data["seq_len"], data["checkpointing"], points)
