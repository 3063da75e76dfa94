"""The random-init BlenderBot builder: BlenderBot's special tokens, sizes, generation defaults, loadable dir."""

import json

import torch
from transformers import AutoTokenizer, BlenderbotConfig, BlenderbotForConditionalGeneration, GenerationConfig

from chat_e.models import GENERATION_DEFAULTS, SIZES, build


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
