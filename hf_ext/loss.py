"""The loss of models that average their own batch: normalized over the whole global batch, as stock normalizes the
others.

transformers divides a model's summed token loss by ``num_items_in_batch``, the labelled tokens of every micro-batch
of the optimizer step on every rank, so that the gradient does not depend on how the global batch is split over
ranks and accumulation steps. The BART family (BlenderBot, T5, Pegasus...) computes ``CrossEntropyLoss()`` itself: the
mean over its own micro-batch, whatever ``num_items_in_batch`` says. The step's gradient is then the mean of
per-micro-batch means, which weighs a token by how many tokens share its micro-batch: 16 rows on 1 rank and 8 + 8 on
2 ranks train differently, and ``batch_rebalance``, which puts long rows into small micro-batches and short rows into
large ones, makes the difference large (37 % of the update after 20 steps of the tiny BlenderBot recipe).

For those models hf-ext takes the loss from the logits: the cross-entropy summed over the labelled tokens, divided
by ``num_items_in_batch`` (:func:`global_token_mean_loss`, the Trainer's public ``compute_loss_func``). Stock then
scales it exactly as it scales a model that uses ``num_items_in_batch``, and a run gives the same gradient on any
world size and accumulation split up to the order fp32 sums it in. Mixture-of-experts models of the family add router
losses that are per-micro-batch means by design; they keep their own loss.
"""

from __future__ import annotations

import inspect
import sys

import torch

from .model_info import base_model_of

#: model types whose ``forward`` takes ``**kwargs`` but returns the mean loss of its own batch, whatever
#: ``num_items_in_batch`` says (they compute ``CrossEntropyLoss()`` themselves, not ``self.loss_function``).
#: ``tests/unit/test_loss_rule.py`` checks each against a hand-computed mean cross-entropy.
OWN_MEAN_LOSS_MODEL_TYPES = frozenset(
    {
        "bart",
        "mbart",
        "plbart",
        "mvp",
        "blenderbot",
        "blenderbot-small",
        "marian",
        "pegasus",
        "pegasus_x",
        "bigbird_pegasus",
        "led",
        "m2m_100",
        "nllb-moe",
        "t5",
        "mt5",
        "umt5",
        "longt5",
        "switch_transformers",
    }
)

#: those whose loss adds mixture-of-experts router terms (with ``output_router_logits``): kept as the model computes it
ROUTER_LOSS_MODEL_TYPES = frozenset({"nllb-moe", "switch_transformers"})


def _model_type(model) -> str | None:
    return getattr(getattr(base_model_of(model), "config", None), "model_type", None)


def loss_ignores_num_items(model) -> bool:
    """True when the model averages its own loss although its ``forward`` takes ``**kwargs`` (BART family,
    BlenderBot): by the model's own ``accepts_loss_kwargs`` when it declares one, else by its model type.

    The stock Trainer then believes the model divides by the token count of the *global* batch, and multiplies the
    loss by the number of processes: the logged loss and the gradients come out N times too large on N ranks.
    """
    if model is None:
        return False
    if hasattr(base_model_of(model), "accepts_loss_kwargs"):
        return False  # the model says itself; stock reads the same attribute
    return _model_type(model) in OWN_MEAN_LOSS_MODEL_TYPES


def decoder_inputs_from_labels(model):
    """What builds the decoder inputs from the labels as the model's own ``forward`` does when it gets labels: its
    ``prepare_decoder_input_ids_from_labels`` (BART, T5, Pegasus...), else its module's
    ``shift_tokens_right(labels, pad_token_id, decoder_start_token_id)`` (BlenderBot, M2M100); ``None`` for neither."""
    base = base_model_of(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if prepare is not None:
        return lambda labels: prepare(labels=labels)
    # the model's class, or the one FSDP2 derives from it (defined in torch's module)
    modules = (sys.modules.get(cls.__module__) for cls in type(base).__mro__)
    shift = next((m.shift_tokens_right for m in modules if hasattr(m, "shift_tokens_right")), None)
    if shift is None or list(inspect.signature(shift).parameters)[1:] != ["pad_token_id", "decoder_start_token_id"]:
        return None
    config = base.config
    return lambda labels: shift(labels, config.pad_token_id, config.decoder_start_token_id)


def adds_router_loss(model) -> bool:
    """True when the model's own loss adds mixture-of-experts router terms to the cross-entropy: a decoder-only MoE
    (Mixtral, Qwen2-MoE, OLMoE...) with ``output_router_logits`` on, or a model type of
    :data:`ROUTER_LOSS_MODEL_TYPES`. A loss hf-ext computes from the logits alone would drop those terms."""
    config = getattr(base_model_of(model), "config", None) if model is not None else None
    return bool(getattr(config, "output_router_logits", False)) or _model_type(model) in ROUTER_LOSS_MODEL_TYPES


def takes_global_token_mean(model) -> bool:
    """True when hf-ext replaces the model's own per-micro-batch mean by :func:`global_token_mean_loss`: an
    encoder-decoder of :data:`OWN_MEAN_LOSS_MODEL_TYPES` (labels aligned with its logits) without router losses, whose
    decoder inputs can be built from the labels as its ``forward`` builds them."""
    config = getattr(base_model_of(model), "config", None) if model is not None else None
    return (
        loss_ignores_num_items(model)
        and bool(getattr(config, "is_encoder_decoder", False))
        and not adds_router_loss(model)
        and decoder_inputs_from_labels(model) is not None
    )


def global_token_mean_loss(outputs, labels, num_items_in_batch=None):
    """The cross-entropy of an encoder-decoder's logits against its (unshifted) labels, summed over the labelled
    tokens and divided by ``num_items_in_batch`` (the labelled tokens of the whole global batch); their mean when no
    count is given (``CrossEntropyLoss()``, what the model computes itself). Computed in fp32, as transformers' own
    loss functions do."""
    logits = outputs["logits"]
    labels = labels.to(logits.device)
    flat_logits, flat_labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
    loss = torch.nn.functional.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def with_decoder_inputs(build, inputs: dict) -> dict:
    """``inputs`` with the decoder inputs ``build`` (:func:`decoder_inputs_from_labels`) makes from the labels, for a
    forward that gets no labels (``compute_loss_func`` takes them out first); the collator's own ones are kept."""
    if "labels" not in inputs or "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs:
        return inputs
    return {**inputs, "decoder_input_ids": build(inputs["labels"])}


#: transformers' loss under DeepSpeed's Ulysses sequence parallelism (``integrations.deepspeed.
#: deepspeed_sp_compute_loss``) is the whole group's token mean on every rank of the group, from a differentiable
#: ``all_gather`` whose backward sums the gradient over the group: each rank's share of the gradient arrives
#: ``sp_size`` times. DeepSpeed then sums the group's gradients (it divides by ``dp_size / sp_size``, the convention
#: of a loss that is each rank's part; deepspeedai/DeepSpeed#5248). The step's gradient, its logged norm and the norm
#: clipping compares with ``max_grad_norm`` come out ``sp_size`` times the one-rank run's. Measured on the versions
#: below (tests/distributed/test_parallel_layouts.py: the norm exactly 2x at sp_size 2; plain SGD without clipping
#: moves the weights twice as far); other versions are left as they are.
ULYSSES_SUMMED_GRADIENT = {"transformers": ">=5.23,<5.24", "deepspeed": ">=0.19,<0.20"}
#: where the rule comes from upstream: the loss's aggregation (its differentiable ``all_gather``) and DeepSpeed's sum
ULYSSES_SOURCES = "huggingface/transformers#47073, deepspeedai/DeepSpeed#5248"


def ulysses_gradient_factor(args, versions: dict) -> int:
    """``sp_size`` when ``args`` run DeepSpeed's Ulysses (accelerate's ``parallelism_config`` with ``sp_backend
    "deepspeed"``) and ``versions`` (package -> installed ``Version``, as ``hf_ext.deepspeed.versions.installed``
    gives them) are those of :data:`ULYSSES_SUMMED_GRADIENT`, else 1."""
    from packaging.specifiers import SpecifierSet  # noqa: PLC0415 (only a Ulysses run reads versions)

    config = getattr(args, "parallelism_config", None)
    sp = getattr(config, "sp_size", None) or 1
    if sp <= 1 or getattr(config, "sp_backend", None) != "deepspeed" or not getattr(args, "deepspeed", None):
        return 1
    for package, specifier in ULYSSES_SUMMED_GRADIENT.items():
        if versions.get(package) is None or versions[package] not in SpecifierSet(specifier):
            return 1
    return int(sp)


def ulysses_rule(factor: int) -> str:
    """The correction of :func:`ulysses_gradient_factor` in one line: the trainer says it at its start, ``hf-ext ds
    doctor`` lists it among the version rules that applied."""
    where = " with ".join(f"{package}{specifier}" for package, specifier in ULYSSES_SUMMED_GRADIENT.items())
    return (
        f"parallelism_config.sp_size {factor} (Ulysses): transformers' loss gives every rank its share of the "
        f"gradient {factor} times and DeepSpeed sums them; hf-ext divides the gradient by {factor}, the logged "
        f"loss unchanged ({where}; {ULYSSES_SOURCES})"
    )


def with_gradient_divided(loss: torch.Tensor, factor: int) -> torch.Tensor:
    """``loss``'s value, with its gradient divided by ``factor``: the logged loss stays the mean it is."""
    part = loss / factor
    return part + (loss - part).detach()
