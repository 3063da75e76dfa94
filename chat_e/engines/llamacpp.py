"""LlamaCppEngine: a GGUF model served by llama.cpp (``llama-cpp-python``), the engine protocol as the local engine
speaks it.

llama.cpp runs the network; everything around it is the local engine's own code, so that the same request makes the
same reply: the prompt is the Transformers tokenizer's (read from the GGUF file) encoding of the same context
(:meth:`LocalEngine.encode`), the next token is chosen from llama.cpp's logits by transformers' own logits processors
in ``generate``'s order (the model's repetition penalty and n-gram ban, the reply's shortest length, the request's
OpenAI penalties and seeded sampling, then temperature, top-k and top-p when sampling), and the reply's text, finish
reason and token counts are made as :class:`LocalEngine` makes them. On a greedy reply the F16 GGUF therefore differs
from the fp32 model only where their logits order two tokens differently (docs/benchmarks.md).

llama.cpp keeps one context: replies take turns (a lock), and a reply reuses the key-value cache of the prompt
prefix it shares with the one before (a chat's next turn re-reads only what is new). Beam search is not llama.cpp's:
``num_beams`` above 1 runs as one beam, as :meth:`describe` says.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
import weakref
from collections.abc import Generator
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from hf_ext.saving.export import export_gguf
from hf_ext.saving.gguf import GGUF_ARCHITECTURES, GGUF_INSTALL, GGUFError, gguf_fields
from hf_ext.saving.model_dir import ModelDirError as ModelLoadError
from hf_ext.saving.model_dir import describe_model_dir, is_gguf_file

from ..data.limits import Request
from ..data.messages import stripped_pieces
from ..data.settings import GenerationSettings, Reply
from .base import StopReply, StreamedEngine
from .local import LocalEngine, _one_line
from .sampling import sampling_processors, sampling_warpers

logger = logging.getLogger(__name__)

#: the longest window llama.cpp's context is made for (a chat's prompt is at most 512 tokens; its fp32 attention
#: cache is allocated whole: 94 MB for SmolLM2-135M at 2048)
MAX_WINDOW = 2048

#: what a model's generation config may set that this engine honours (anything else is logged at load)
HONOURED = {
    *("repetition_penalty", "no_repeat_ngram_size", "temperature", "top_k", "top_p", "do_sample", "num_beams"),
    *("max_new_tokens", "min_new_tokens", "eos_token_id", "pad_token_id", "bos_token_id"),
}


def llama_cpp_installed() -> bool:
    """Whether llama-cpp-python is installed (``hf-ext[gguf]``)."""
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_exportable(model: str | Path) -> bool:
    """Whether the model directory ``model`` (a full model, or an adapter on one) can be written as GGUF: a
    Llama-architecture causal LM (read from its config files; nothing is loaded)."""
    try:
        found = describe_model_dir(model)
    except ModelLoadError:
        return False
    config_dir = Path(found["base"]) if found["kind"] == "adapter" else Path(found["path"])
    try:
        architectures = json.loads((config_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return bool(architectures) and architectures[0] in GGUF_ARCHITECTURES


def gguf_path(model_dir: str | Path, kind: str) -> Path:
    """Where a model directory's GGUF export of type ``kind`` is kept: its ``gguf/`` folder."""
    return Path(model_dir) / "gguf" / f"model-{kind}.gguf"


def served_gguf(model: str | Path, kind: str = "f16") -> Path:
    """The GGUF file llama.cpp serves for ``model``: itself when it is one, else the directory's export of type
    ``kind`` (:func:`gguf_path`), written first when it is missing or older than the directory's weights."""
    if is_gguf_file(model):
        return Path(model)
    out = gguf_path(model, kind)
    weights = [p for p in Path(model).iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin")]
    newest = max((p.stat().st_mtime for p in weights), default=0.0)
    if not out.is_file() or out.stat().st_mtime < newest:
        logger.info("writing %s for llama.cpp (once; later loads read it)", out)
        try:
            export_gguf(model, out, kind)
        except (GGUFError, FileNotFoundError, OSError) as err:
            raise ModelLoadError(f"Could not write {model} as GGUF for llama.cpp: {_one_line(err)}") from err
    return out


class LlamaCppEngine(StreamedEngine, LocalEngine):
    """A GGUF model under llama.cpp, with its Transformers tokenizer and generation defaults (from the file).

    Args:
        llm: a ``llama_cpp.Llama`` over the file.
        tokenizer: the Transformers tokenizer of the same vocabulary.
        generation_config: generation defaults.
        name: how the model is shown.
    """

    def __init__(self, llm, tokenizer, generation_config: GenerationConfig, name: str = ""):
        self.llm = llm
        self.model = None
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.family = "causal"
        self.max_positions = int(llm.n_ctx())
        self.max_input_length = self.causal_input_length(self.max_positions)
        self.name = name or str(getattr(llm, "model_path", "gguf"))
        self.info = {}
        self._lock = threading.Lock()
        # llama.cpp's context freed while the interpreter still runs (its own finalizer fails at exit)
        weakref.finalize(self, llm.close)
        self._vocab = int(llm.n_vocab())
        set_here = generation_config.to_diff_dict().items()
        suffixes = ("penalty", "_size", "_ids", "_tokens")
        unused = sorted(key for key, value in set_here if key not in HONOURED and key.endswith(suffixes) and value)
        if unused:
            logger.warning("llama.cpp engine: the model's generation defaults %s are not applied here", unused)

    # ---- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, threads: int | None = None) -> LlamaCppEngine:
        """Load the GGUF file ``path`` (its tokenizer and generation defaults from the file) with ``threads`` CPU
        threads (torch's count when None).

        Raises:
            ModelLoadError: llama-cpp-python is missing, or the file cannot be loaded.
        """
        try:
            import llama_cpp  # noqa: PLC0415 (an extra that compiles at install)
        except ImportError as err:
            raise ModelLoadError(f"A GGUF model is served by llama.cpp; install it: {GGUF_INSTALL}") from err
        path = Path(path)
        started = time.perf_counter()
        try:
            fields = gguf_fields(path)
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            threads = threads or torch.get_num_threads()
            window = int(fields.get(f"{fields.get('general.architecture', 'llama')}.context_length", MAX_WINDOW))
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=min(window, MAX_WINDOW),
                # the attention cache in fp32, as PyTorch's: llama.cpp's default F16 cache moves the logits by up to
                # 0.06 on the tiny test model, more than the gap between its two likeliest tokens at some steps
                type_k=llama_cpp.GGML_TYPE_F32,
                type_v=llama_cpp.GGML_TYPE_F32,
                n_batch=512,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
        except (GGUFError, ValueError, OSError, RuntimeError) as err:
            raise ModelLoadError(f"Could not load the GGUF model {path}: {_one_line(err)}") from err
        generation = GenerationConfig.from_dict(fields["generation_config"] or {})
        if generation.eos_token_id is None:
            generation.eos_token_id = tokenizer.eos_token_id
        engine = cls(llm, tokenizer, generation, name=str(path))
        engine.info = {
            "path": str(path),
            "gguf": str(path),
            "kind": "gguf",
            "file_type": _file_type(fields),
            "threads": threads,
            "load_seconds": round(time.perf_counter() - started, 2),
        }
        return engine

    def describe(self) -> str:
        kind, threads = self.info.get("file_type", "GGUF"), self.info.get("threads")
        window = f"context window {self.max_input_length} tokens"
        return " · ".join([self.name, f"llama.cpp {kind}", f"{threads} threads", window, "one beam"])

    # ---- generation ------------------------------------------------------------------------------------------

    def _processors(self, config, prompt_length: int, sampling) -> tuple[list, list, LogitsProcessorList]:
        """``(the model's penalties, the request's sampling, the sampling warpers)`` for ``config``, in ``generate``'s
        order; the reply's shortest length goes between the first two (:meth:`_tokens`). The request's sampling may
        turn ``config`` greedy (a seeded reply samples in its processor)."""
        penalties = []
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            penalties.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
        if config.no_repeat_ngram_size:
            penalties.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
        requested = list(sampling_processors(sampling, config, prompt_length))
        warpers = sampling_warpers(config) if config.do_sample else LogitsProcessorList()
        return penalties, requested, warpers

    def _settings(self, request: Request) -> GenerationSettings:
        return super()._settings(request).replace(num_beams=1)  # llama.cpp has no beam search

    def _pieces(self, request: Request) -> Generator[str, None, Reply]:
        ids = self.encode(request)
        config = self._generation_config(self._settings(request))
        processors = self._processors(config, len(ids), request.sampling)
        started = time.perf_counter()
        generated: list[int] = []
        tokens = self._tokens(ids, config, processors, generated)
        text = ""
        try:
            for piece in stripped_pieces(self._text(tokens, generated)):
                text += piece
                yield piece
        except StopReply:
            pass  # the reader stopped the reply: what was generated so far is the reply
        finally:
            tokens.close()  # releases llama.cpp's context
        inputs = {"input_ids": torch.tensor([ids])}
        self._log(inputs, len(generated), started, request.mode)
        return self._finished(text, inputs, generated, config)

    def _text(self, tokens, generated: list[int]):
        """The reply's text in pieces as its tokens come (a piece is held back while it ends inside a character)."""
        shown = ""
        for _ in tokens:
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if not text.endswith("\ufffd") and len(text) > len(shown):
                yield text[len(shown) :]
                shown = text
        text = self.tokenizer.decode(generated, skip_special_tokens=True)  # a reply may end inside a character
        if len(text) > len(shown):
            yield text[len(shown) :]

    def _tokens(self, ids: list[int], config, processors, generated: list[int]):
        """Generate after ``ids`` into ``generated``, yielding after each token, under the context's lock."""
        import llama_cpp  # noqa: PLC0415 (an extra that compiles at install)

        ends = set(config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id])
        ends_ids = torch.tensor(sorted(ends))
        penalties, requested, warpers = processors
        with self._lock:
            llm = self.llm
            cached = llm.input_ids[: llm.n_tokens].tolist()
            keep = 0
            while keep < min(len(cached), len(ids) - 1) and cached[keep] == ids[keep]:
                keep += 1
            llm.n_tokens = keep  # eval drops the cache after it
            llm.eval(ids[keep:])
            sequence = torch.tensor([ids], dtype=torch.long)
            while len(generated) < min(config.max_new_tokens, self.max_positions - len(ids)):
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(self._vocab,))
                scores = torch.from_numpy(logits.copy()).unsqueeze(0)
                for processor in penalties:  # one by one: LogitsProcessorList inspects each one's signature per call
                    scores = processor(sequence, scores)
                if len(generated) < config.min_new_tokens:  # the reply's shortest length: its end held off
                    scores[:, ends_ids] = float("-inf")  # (generate's processor builds a vocabulary mask each call)
                for processor in requested:
                    scores = processor(sequence, scores)
                if config.do_sample:
                    probs = torch.softmax(warpers(sequence, scores), dim=-1)
                    token = int(torch.multinomial(probs, 1)[0, 0])
                else:
                    token = int(torch.argmax(scores, dim=-1)[0])
                generated.append(token)
                sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
                yield token
                if token in ends:
                    break
                llm.eval([token])


def _file_type(fields: dict) -> str:
    """A GGUF file's weight type as llama.cpp names it (``F16``, ``Q8_0``, ``Q4_K_M``, ...), from its metadata."""
    import gguf  # noqa: PLC0415 (an extra)

    value = fields.get("general.file_type")
    try:
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return "GGUF"
