"""Random-init BlenderBots with a byte-level BPE tokenizer trained on the offline corpus (tests, demo, benchmarks).

Sizes: ``tiny`` (well under 1M parameters, for tests), ``small`` (a few million, learns the offline corpus in a few
CPU minutes; used by ``make demo``), ``400m`` (facebook/blenderbot-400M-distill's dimensions, for benchmarks).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    BlenderbotTokenizer,
    GenerationConfig,
)

from .corpora import chatterbot_conversations, conversation_pairs

# pad 0, <s> 1, </s> 2, unk 3 as in facebook/blenderbot-400M-distill; <mask> last
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]

SIZES: dict[str, dict] = {
    "tiny": dict(vocab=1024, d_model=32, encoder_layers=2, decoder_layers=2, heads=2, ffn=64),
    "small": dict(vocab=4096, d_model=160, encoder_layers=2, decoder_layers=2, heads=4, ffn=640),
    "400m": dict(vocab=8008, d_model=1280, encoder_layers=2, decoder_layers=12, heads=32, ffn=5120),
}

# facebook/blenderbot-400M-distill's generation defaults
GENERATION_DEFAULTS = dict(
    num_beams=10,
    min_length=20,
    max_length=60,
    length_penalty=0.65,
    no_repeat_ngram_size=3,
    encoder_no_repeat_ngram_size=3,
    forced_eos_token_id=2,
    decoder_start_token_id=1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def corpus_texts() -> list[str]:
    """Every context and response of the offline corpus (headers and separators included)."""
    texts = []
    for conv in chatterbot_conversations():
        for pair in conversation_pairs(conv["category"], conv["turns"]):
            texts += [pair["texts"], pair["labels"]]
    return texts


def train_tokenizer(vocab_size: int) -> BlenderbotTokenizer:
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # room for <mask>
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus_texts(), trainer)
    backend.add_special_tokens(["<mask>"])
    eos = backend.token_to_id("</s>")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
    )
    return BlenderbotTokenizer(tokenizer_object=backend, model_max_length=128)


def build(output_dir: str, size: str = "tiny", seed: int = 0) -> Path:
    dims = SIZES[size]
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(dims["vocab"])
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == [0, 1, 2, 3], f"special token ids {ids} differ from BlenderBot's"
    tokenizer.save_pretrained(out)

    config = BlenderbotConfig(
        vocab_size=max(len(tokenizer), dims["vocab"]),
        d_model=dims["d_model"],
        encoder_layers=dims["encoder_layers"],
        decoder_layers=dims["decoder_layers"],
        encoder_attention_heads=dims["heads"],
        decoder_attention_heads=dims["heads"],
        encoder_ffn_dim=dims["ffn"],
        decoder_ffn_dim=dims["ffn"],
        max_position_embeddings=128,
        scale_embedding=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        forced_eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = BlenderbotForConditionalGeneration(config)
    model.generation_config = GenerationConfig(**GENERATION_DEFAULTS)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "hf_ext_model.json").write_text(json.dumps({"size": size, "seed": seed, "parameters": n_params}) + "\n")
    return out
