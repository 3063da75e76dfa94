"""GGUF, both directions: a plain Transformers model read from a GGUF file, and a model written to one for llama.cpp.

* :func:`read_gguf`: transformers' own GGUF reader (``from_pretrained(..., gguf_file=...)``, dequantized), the
  weights copied into a plain model that ``save_pretrained`` takes.
* :func:`write_gguf`: a Llama-architecture causal LM (Llama, SmolLM2) with its tokenizer, chat template and
  generation defaults, in F16 or F32 through the ``gguf`` package's writer (its tensor-name map and special-vocab
  reader); Q8_0 and the 4-bit type llama.cpp recommends (Q4_K_M) from that file by llama.cpp's own quantizer
  (``llama-cpp-python``'s ``llama_model_quantize``). Every file is written beside its target and renamed over it once
  complete (:func:`hf_ext.atomic.atomic_file`): a killed export leaves the old file or none, never half of one.
* :func:`gguf_fields`: a GGUF file's metadata, and the generation defaults the writer stored in it
  (:data:`GENERATION_CONFIG_KEY`).

What llama.cpp's ``convert_hf_to_gguf.py`` does for a Llama model is done here the same way, in a few lines: the
query and key projections' rows permuted to llama.cpp's rotary layout, a tied output head left out (llama.cpp reads
the token embeddings instead), the BPE pre-tokenizer named by the hash of the tokens of llama.cpp's own probe text.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from ..atomic import atomic_file, remove_file_leftovers, work_path

logger = logging.getLogger(__name__)

#: the quantization types ``hf-ext export --format gguf`` writes: llama.cpp's names, lower case
GGUF_TYPES = ("f16", "f32", "q8_0", "q4_k_m")
#: the types a finished model is written in by Chat-E's Train page and served in by ``chat-e --engine llamacpp``:
#: F16 (the fp32 model's replies) and llama.cpp's two usual quantizations
GGUF_SET = ("f16", "q8_0", "q4_k_m")
#: llama.cpp's ``llama_ftype`` of each type its quantizer makes
QUANTIZED = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
#: the metadata key holding the model's generation defaults (``generation_config.json``'s text)
GENERATION_CONFIG_KEY = "hf_ext.generation_config"
#: what a GGUF export needs beyond the core install
GGUF_INSTALL = "pip install 'hf-ext[gguf]'  (or: make setup)"

#: llama.cpp's pre-tokenizer probe (``convert_hf_to_gguf.py``'s ``chktxt``): the sha256 of ``str(tokenizer.encode(it))``
#: names a BPE tokenizer's pre-tokenizer
_PROBE = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= "
    "нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure "
    "I'll make it, 'D you like some tea? We'Ve a'lL"
)
#: the probe hashes of the tokenizers Chat-E ships (llama.cpp's table has the rest)
_KNOWN_PRE = {"855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm"}
#: the architectures :func:`write_gguf` writes
GGUF_ARCHITECTURES = ("LlamaForCausalLM",)


class GGUFError(ValueError):
    """A model GGUF cannot hold, or a GGUF file that cannot be read; the message says why and what to do."""


# ---- reading ---------------------------------------------------------------------------------------------------


def read_gguf(path: str | Path, dtype=None):
    """``(model, tokenizer)`` of the GGUF file ``path``, dequantized to ``dtype``, as a plain model (no GGUF
    quantization config: ``save_pretrained`` takes it; tied embeddings stay tied)."""
    import torch  # noqa: PLC0415 (heavy: this module's names are read by CLI parsers)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415 (an extra)

    dtype = dtype or torch.float32

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    read = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    config_dict = {k: v for k, v in read.config.to_dict().items() if k != "quantization_config"}
    config = AutoConfig.for_model(**config_dict)
    model = type(read)(config).to(dtype)
    model.load_state_dict(read.state_dict())
    return model.eval(), tokenizer


def gguf_fields(path: str | Path) -> dict:
    """A GGUF file's metadata with scalar, string and short-array values (the vocabulary's long arrays left out), and
    ``generation_config``: the generation defaults :func:`write_gguf` stored (None in a file from elsewhere)."""
    import gguf  # noqa: PLC0415 (an extra)

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise GGUFError(f"{path} is not a readable GGUF file: {err}") from err
    fields = {}
    for key, field in reader.fields.items():
        if len(field.data) > 64:
            continue
        with contextlib.suppress(Exception):  # a field type gguf cannot render is left out
            fields[key] = field.contents()
    fields["generation_config"] = (
        json.loads(fields[GENERATION_CONFIG_KEY]) if GENERATION_CONFIG_KEY in fields else None
    )
    return fields


# ---- writing ---------------------------------------------------------------------------------------------------


def _check_model(model) -> None:
    architectures = getattr(model.config, "architectures", None) or [type(model).__name__]
    if architectures[0] not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"GGUF export writes Llama-architecture causal LMs ({', '.join(GGUF_ARCHITECTURES)}); this model is "
            f"{architectures[0]}. Export it with --merge to a directory and convert that with llama.cpp's "
            "convert_hf_to_gguf.py."
        )
    rope = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise GGUFError(
            f"GGUF export writes models with the default rotary embedding; this one has rope_type "
            f"{rope['rope_type']!r}: convert it with llama.cpp's convert_hf_to_gguf.py."
        )


def _permute(weight, heads: int):
    """A query or key projection's rows in llama.cpp's rotary order (each head's two halves interleaved)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def pre_tokenizer(tokenizer) -> str:
    """llama.cpp's name for ``tokenizer``'s BPE pre-tokenizer: by its probe hash, else ``gpt-2`` for a byte-level
    tokenizer with GPT-2's split (a :class:`GGUFError` otherwise)."""
    digest = hashlib.sha256(str(tokenizer.encode(_PROBE)).encode()).hexdigest()
    if digest in _KNOWN_PRE:
        return _KNOWN_PRE[digest]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    pre = json.loads(backend.to_str()).get("pre_tokenizer") if backend is not None else None
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    raise GGUFError(
        f"GGUF export names a tokenizer's pre-tokenizer for llama.cpp; this one ({pre}) is not known here: convert "
        "the model with llama.cpp's convert_hf_to_gguf.py, which knows more."
    )


def _add_vocabulary(writer, tokenizer, vocab_size: int, tokenizer_dir: Path) -> None:
    import gguf  # noqa: PLC0415 (an extra)

    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    # merges, special token ids and the chat template, as the saved tokenizer files say; whether a start or end token
    # is added, as the tokenizer does it (transformers' saved files need not say)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=True, n_vocab=vocab_size)
    ids = tokenizer("a").input_ids
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id]
    special.add_to_gguf(writer)


def _add_hyperparameters(writer, config, name: str, file_type) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(file_type)


def _tensors(model, dtype: str):
    """``(gguf name, array)`` of every weight: 2-D weights in ``dtype``, norms in F32, q/k permuted, a tied head
    left out."""
    import gguf  # noqa: PLC0415 (an extra)
    import numpy as np  # noqa: PLC0415 (heavy: this module is read by CLI parsers)
    import torch  # noqa: PLC0415 (heavy: this module is read by CLI parsers)

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GGUFError(f"GGUF export has no llama.cpp name for the weight {name!r}.")
        tensor = tensor.detach().to(torch.float32)
        if name.endswith("q_proj.weight"):
            tensor = _permute(tensor, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = _permute(tensor, config.num_key_value_heads)
        array = tensor.numpy()
        yield gguf_name, array.astype(np.float16 if dtype == "f16" and array.ndim == 2 else np.float32)


def _write_plain(model, tokenizer, path: Path, dtype: str, name: str, generation_config) -> None:
    import gguf  # noqa: PLC0415 (an extra)

    file_type = gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32
    scratch = work_path(path)
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer.save_pretrained(scratch)  # the gguf package reads merges and special tokens from the files
        with atomic_file(path) as staged:
            writer = gguf.GGUFWriter(str(staged), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
            _add_hyperparameters(writer, model.config, name, file_type)
            _add_vocabulary(writer, tokenizer, model.config.vocab_size, scratch)
            if generation_config is not None:
                writer.add_string(GENERATION_CONFIG_KEY, generation_config.to_json_string(use_diff=True))
            for gguf_name, array in _tensors(model, dtype):
                writer.add_tensor(gguf_name, array)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def quantize_gguf(src: str | Path, out: str | Path, kind: str, threads: int = 0) -> Path:
    """``src`` (an F16 or F32 GGUF file) quantized by llama.cpp to ``kind`` (:data:`QUANTIZED`) in ``out``."""
    try:
        import llama_cpp  # noqa: PLC0415 (an extra that compiles at install)
    except ImportError as err:
        raise GGUFError(f"GGUF {kind.upper()} is made by llama.cpp's quantizer; install it: {GGUF_INSTALL}") from err
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZED[kind])
    params.nthread = threads
    out = Path(out)
    with atomic_file(out) as staged, _c_stderr() as said:
        status = llama_cpp.llama_model_quantize(str(src).encode(), str(staged).encode(), params)
        if status != 0:
            raise GGUFError(f"llama.cpp could not quantize {src} to {kind.upper()} (status {status}): {said()[-500:]}")
    return out


@contextlib.contextmanager
def _c_stderr():
    """What C code writes to the process's standard error meanwhile (llama.cpp's quantizer: a line per tensor),
    kept in a temporary file and logged at debug level; yields a function that returns it so far."""
    import sys  # noqa: PLC0415 (the standard library, for the capture only)
    import tempfile  # noqa: PLC0415 (the standard library, for the capture only)

    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)

        def said() -> str:
            captured.seek(0)
            return captured.read().decode(errors="replace")

        try:
            yield said
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            logger.debug("llama.cpp: %s", said())


def write_gguf(
    model, tokenizer, out: str | Path, kind: str = "f16", *, name: str = "", generation_config=None
) -> Path:
    """``model`` (a Llama-architecture causal LM) with its tokenizer, chat template and ``generation_config`` (the
    model's own when None) as one GGUF file of type ``kind`` (:data:`GGUF_TYPES`) at ``out``, all-or-nothing."""
    if kind not in GGUF_TYPES:
        raise GGUFError(f"GGUF type {kind!r} is not written here; choose one of {', '.join(GGUF_TYPES)}.")
    _check_model(model)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_file_leftovers(out)  # an earlier export killed mid-write
    generation_config = generation_config if generation_config is not None else model.generation_config
    name = name or out.stem
    if kind not in QUANTIZED:
        _write_plain(model, tokenizer, out, kind, name, generation_config)
        return out
    scratch = work_path(out)  # llama.cpp quantizes from the exact fp32 weights, written here first
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        plain = scratch / "f32.gguf"
        _write_plain(model, tokenizer, plain, "f32", name, generation_config)
        return quantize_gguf(plain, out, kind)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
