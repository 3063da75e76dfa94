"""The loss fix decides by an explicit list of model types: each listed model really returns the mean cross-entropy
of its own batch whatever ``num_items_in_batch`` says (oracle: ``torch.nn.functional.cross_entropy`` on its logits),
and a model that divides by ``num_items_in_batch`` (Llama) is left to stock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_ext.loss import (
    OWN_MEAN_LOSS_MODEL_TYPES,
    ROUTER_LOSS_MODEL_TYPES,
    decoder_inputs_from_labels,
    global_token_mean_loss,
    loss_ignores_num_items,
    takes_global_token_mean,
    ulysses_gradient_factor,
    with_decoder_inputs,
    with_gradient_divided,
)

BART_LIKE = dict(
    d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
    encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=64, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
)  # fmt: skip
T5_LIKE = dict(
    d_model=16, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=8, vocab_size=64,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)  # fmt: skip
EXTRA = {"bigbird_pegasus": {"attention_type": "original_full"}, "switch_transformers": {"num_experts": 2}}
NUM_ITEMS = 1000  # far from the batch's 8 label tokens: a model that used it would return loss / 125


def tiny_seq2seq(model_type: str):
    kwargs = dict(T5_LIKE if "t5" in model_type or model_type == "switch_transformers" else BART_LIKE)
    kwargs.update(EXTRA.get(model_type, {}))
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    return AutoModelForSeq2SeqLM.from_config(config).eval()


def mean_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
    )


@pytest.mark.parametrize("model_type", sorted(OWN_MEAN_LOSS_MODEL_TYPES))
def test_listed_models_average_their_own_loss(model_type):
    model = tiny_seq2seq(model_type)
    assert loss_ignores_num_items(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 60, (2, 7), generator=g)
    labels = torch.randint(4, 60, (2, 5), generator=g)
    labels[0, -2:] = -100
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, num_items_in_batch=NUM_ITEMS)
    # aux losses (mixture-of-experts routers) are off in these configs: the loss is the plain token mean
    torch.testing.assert_close(out.loss, mean_ce(out.logits, labels), rtol=1e-5, atol=1e-5)
    # hf-ext's replacement: the same forward without labels (decoder inputs built as the model builds them), the
    # summed token loss over a count; with the batch's own count it is the model's own loss
    assert takes_global_token_mean(model) == (model_type not in ROUTER_LOSS_MODEL_TYPES)
    if not takes_global_token_mean(model):
        return
    with torch.no_grad():
        bare = model(**with_decoder_inputs(decoder_inputs_from_labels(model), {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                   "labels": labels}) | {"labels": None})  # fmt: skip
    own_count = int((labels != -100).sum())
    torch.testing.assert_close(global_token_mean_loss(bare, labels, own_count), out.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(global_token_mean_loss(bare, labels, torch.tensor(NUM_ITEMS)),
                               out.loss * own_count / NUM_ITEMS, rtol=1e-5, atol=1e-7)  # fmt: skip


def test_a_model_that_divides_by_num_items_is_left_to_stock():
    config = AutoConfig.for_model(
        "llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert not loss_ignores_num_items(model)
    ids = torch.randint(4, 60, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, num_items_in_batch=NUM_ITEMS)
    total = mean_ce(out.logits[:, :-1], ids[:, 1:]) * (ids.shape[1] - 1)
    torch.testing.assert_close(out.loss, total / NUM_ITEMS, rtol=1e-5, atol=1e-6)


def test_a_model_that_declares_accepts_loss_kwargs_decides_itself():
    model = tiny_seq2seq("bart")
    model.accepts_loss_kwargs = True
    assert not loss_ignores_num_items(model)
    assert not loss_ignores_num_items(None)


# --- DeepSpeed's Ulysses: the gradient divided back by sp_size (hf_ext.loss.ulysses_gradient_factor) --------------
# The measured versions' factor, and none elsewhere; the 2-rank run it corrects: tests/distributed/test_parallel_layouts.py
ZERO1 = {"zero_optimization": {"stage": 1}}


def test_the_ulysses_correction_applies_on_the_measured_versions_only():
    measured = {"transformers": Version("5.23.0"), "deepspeed": Version("0.19.8")}
    ulysses = SimpleNamespace(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"), deepspeed=ZERO1)
    assert ulysses_gradient_factor(ulysses, measured) == 2
    assert ulysses_gradient_factor(ulysses, {**measured, "transformers": Version("5.24.0")}) == 1
    assert ulysses_gradient_factor(ulysses, {**measured, "deepspeed": Version("0.20.0")}) == 1
    # no DeepSpeed, another backend, no sequence parallelism: nothing to correct
    assert ulysses_gradient_factor(SimpleNamespace(parallelism_config=ulysses.parallelism_config, deepspeed=None),
                                   measured) == 1  # fmt: skip
    assert ulysses_gradient_factor(SimpleNamespace(parallelism_config=ParallelismConfig(cp_size=2), deepspeed=ZERO1),
                                   measured) == 1  # fmt: skip
    assert ulysses_gradient_factor(SimpleNamespace(parallelism_config=None, deepspeed=ZERO1), measured) == 1


def test_the_divided_gradient_keeps_the_loss_value():
    weight = torch.tensor([3.0, -1.5], requires_grad=True)
    loss = (weight**2).sum() / 7
    divided = with_gradient_divided(loss, 2)
    assert divided.item() == loss.item()
    divided.backward()
    assert torch.allclose(weight.grad, 2 * weight.detach() / 7 / 2)
