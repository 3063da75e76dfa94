"""The model side of the memory plan: parameter counts and an activation probe (one forward + backward of a
random-init copy of the model at micro-batch 1 and 2, peak allocated bytes from the torch profiler)."""

from __future__ import annotations

from ..model_info import hidden_size_buckets, hidden_size_of, random_init_model
from .formulas import ActivationProfile, ModelFacts


def model_facts(model, checkpoint_bytes: int = 0) -> ModelFacts:
    params = list(model.parameters())
    hidden = hidden_size_of(model)
    threshold = hidden_size_buckets(hidden)["stage3_param_persistence_threshold"][0] if hidden else 0
    return ModelFacts(
        num_params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        hidden_size=hidden,
        persistent_params=sum(p.numel() for p in params if p.numel() < threshold),
        largest_param=max((p.numel() for p in params), default=0),
        checkpoint_bytes=checkpoint_bytes,
    )


def probe_inputs(model, batch: int, seq_len: int) -> dict:
    """Random inputs of ``batch`` x ``seq_len`` tokens that make any HF LM / seq2seq / classifier compute a loss."""
    import torch

    config = model.config
    vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 1000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(min(4, vocab - 1), vocab, (batch, seq_len), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        inputs["labels"] = torch.randint(min(4, vocab - 1), vocab, (batch, seq_len), generator=g)
    elif "ForSequenceClassification" in type(model).__name__:
        inputs["labels"] = torch.zeros(batch, dtype=torch.long)
    elif "ForCausalLM" in type(model).__name__ or "LMHead" in type(model).__name__:
        inputs["labels"] = ids.clone()
    return inputs


def _peak_allocated(fn) -> int:
    """Peak bytes allocated (above the level at the start) by the CPU allocator while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        ((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda x: x[0],
    )
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def _enable_checkpointing(enable):
    import inspect

    names = inspect.signature(enable).parameters
    kwargs_name = next((n for n in names if n.endswith("checkpointing_kwargs")), None)
    enable(**({kwargs_name: {"use_reentrant": False}} if kwargs_name else {}))


def probe_activations(model, seq_len: int, batches=(1, 2), checkpointing: bool = False) -> ActivationProfile:
    """Measure the activation memory of ``model`` (fp32, on CPU) at each micro-batch in ``batches``.

    Gradients are allocated before the pass (they are model states, counted apart), so the peak is activations,
    their gradients and the transient gradient of one parameter. With ``checkpointing``, the model's activation
    checkpointing is switched on for the probe (non-reentrant) and restored after.
    """
    import torch

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


def _load_model(model):
    """A model to probe: ``model`` itself, or a random-init copy of the architecture ``model`` names."""
    if hasattr(model, "parameters"):
        return model, False
    return random_init_model(model), True


def measure(model, seq_len: int, checkpointing: bool) -> dict:
    """Model facts and activation profile of ``model`` (object, config or path) as a JSON-able dict."""
    import gc

    probe_model, built = _load_model(model)
    facts = model_facts(probe_model)
    profile = probe_activations(probe_model, seq_len, (1, 2), checkpointing)
    if built:
        del probe_model
        gc.collect()
    return {"facts": facts.__dict__, "seq_len": seq_len, "checkpointing": checkpointing, "points": profile.points}


def from_measurement(data: dict) -> tuple[ModelFacts, ActivationProfile]:
    facts = ModelFacts(**data["facts"])
    points = [tuple(p) for p in data["points"]]
    return facts, ActivationProfile(data["seq_len"], data["checkpointing"], points)
