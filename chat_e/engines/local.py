"""LocalEngine: load a fine-tuned dialogue model, build its context, generate or stream a reply.

Both model families are served: an encoder-decoder (BlenderBot) reads the MuDoConv string, a decoder-only chat model
(SmolLM2-135M-Instruct) its chat template with the persona/emotion/domain/topic header as the system message.

The engine takes a chat as plain turns: the user's newest message and the earlier turns as strings, oldest first,
speakers alternating. It neither reads message shapes nor cleans text: the UI (:mod:`chat_e.web.ui`) and the ``chat``
API endpoint hand it what :func:`chat_e.data.limits.check_request` made of a request (with :mod:`chat_e.data.messages`), once
per reply. No Gradio here: the UI is a thin layer over this module, which is tested on its own.

The context is built by :mod:`chat_e.data.dialogue` -- the same code that prepares the training data -- so what the bot
sees at serving time is exactly what it was trained on::

    engine = LocalEngine.from_pretrained("runs/demo/final")
    engine.reply(Request("Hi! Any plans for the summer?", mode="domain", context="vacation ideas")).text
    greedy = engine.default_settings().replace(num_beams=1)
    for piece in engine.stream(Request("Tell me more.", ["Hi!", "Hello there."], settings=greedy)):
        print(piece, end="", flush=True)
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, StoppingCriteriaList, TextIteratorStreamer

from hf_ext.model_info import model_class
from hf_ext.saving.model_dir import ModelDirError as ModelLoadError
from hf_ext.saving.model_dir import describe_model_dir

from ..data.dialogue import encode_history, family_of, normalize_mode
from ..data.limits import Request
from ..data.messages import stripped_pieces
from ..data.settings import LENGTH, STOP, GenerationSettings, Reply
from .base import ChatEngine, ReplyStream, StopReply
from .sampling import sampling_processors

logger = logging.getLogger(__name__)

#: Longest input of a decoder-only model: its newest tokens (its position window is far longer than a chat needs, and
#: a CPU pays for every prompt token on every reply)
MAX_CAUSAL_INPUT_TOKENS = 512
DTYPES = ("fp32", "bf16")
QUANTIZE = ("none", "int8")


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"))


def int8_layers(model) -> set[str]:
    """The ``nn.Linear`` layers :func:`quantize_int8` turns to int8: all of an encoder-decoder's; a decoder-only
    model's feed-forward layers only. Its attention projections and output head stay fp32: with them in int8,
    SmolLM2-135M-Instruct misses its end-of-turn token and runs on into junk (docs/benchmarks.md, "Chat-E serving:
    SmolLM2-135M-Instruct")."""
    skip = set()
    if family_of(model.config) == "causal":
        head = model.get_output_embeddings()
        skip = {
            name
            for name, module in model.named_modules()
            if module is head or any(part.endswith(("attn", "attention")) for part in name.split("."))
        }
    return {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear) and name not in skip}


def quantize_int8(model):
    """Dynamic int8 quantization (weights int8, activations quantized on the fly) of :func:`int8_layers`."""
    with warnings.catch_warnings():  # torch.ao's eager quantization warns that it is moving to torchao
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, int8_layers(model), dtype=torch.qint8)


class _Cancelled:
    """A stopping criterion that ends generation when its event is set (the reader went away)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class LocalEngine(ChatEngine):
    """A dialogue model, its tokenizer and generation defaults, and its family's context format.

    A chat reaches it as plain turns -- the user's newest ``message`` and the earlier ``history``, strings oldest first,
    speakers alternating -- and a context mode name. It trusts them: no message shapes are read and no text is
    cleaned or cut here. Chat-E's server makes them so once per request (:func:`chat_e.data.limits.check_request`, by
    :mod:`chat_e.data.messages`' rules); only what exceeds the model's window is cut, by :mod:`chat_e.data.dialogue`.

    Args:
        model: an encoder-decoder (MuDoConv inputs) or a decoder-only chat model (chat-template inputs).
        tokenizer: its tokenizer.
        generation_config: generation defaults (the model's own when None).
        max_input_length: longest model input in tokens (the model's ``max_position_embeddings`` when None).
        name: how the model is shown in the UI.
    """

    def __init__(self, model, tokenizer, generation_config=None, max_input_length: int | None = None, name: str = ""):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.generation_config = copy.deepcopy(generation_config or model.generation_config)
        self.family = family_of(model.config)
        positions = getattr(model.config, "max_position_embeddings", None) or tokenizer.model_max_length
        if self.family == "causal":
            max_input_length = max_input_length or self.causal_input_length(int(positions))
        self.max_input_length = int(max_input_length or positions)
        self.max_positions = int(positions)
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        self.info: dict[str, Any] = {}

    @staticmethod
    def causal_input_length(positions: int) -> int:
        """A decoder-only model's longest prompt: the reply shares the window with it."""
        return min(MAX_CAUSAL_INPUT_TOKENS, positions // 2)

    # ---- loading ---------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(  # long: one load, each kind of directory and each failure said in one line
        cls, path: str | Path, dtype: str = "fp32", quantize: str = "none", device: str = "cpu"
    ) -> LocalEngine:
        """Load a recipe's model directory: a 16-bit save or an exported merge (``config.json``), or a PEFT adapter
        (``adapter_config.json``, merged into its base at load).

        Args:
            path: the model directory.
            dtype: ``fp32`` (default; CPU half precision is slow) or ``bf16``.
            quantize: ``none`` or ``int8`` (dynamic quantization of the linear layers; needs ``fp32``).
            device: torch device.

        Raises:
            ModelLoadError: the directory is missing, is not a model directory, or its files cannot be loaded.
        """
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; choose one of {', '.join(DTYPES)}.")
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize={quantize!r} is not supported; choose one of {', '.join(QUANTIZE)}.")
        if quantize == "int8" and (dtype != "fp32" or device != "cpu"):
            raise ValueError("int8 dynamic quantization runs on CPU in fp32: drop --dtype bf16 or --quantize int8.")
        found = describe_model_dir(path)
        path = found["path"]

        torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
        started = time.perf_counter()
        try:
            if found["kind"] == "adapter":
                from peft import PeftModel  # noqa: PLC0415 (optional path: adapters only; peft's import is slow and a merged model needs none)

                base = found["base"]
                try:
                    model = model_class(AutoConfig.from_pretrained(str(base))).from_pretrained(
                        str(base), dtype=torch_dtype
                    )
                except Exception as err:
                    raise ModelLoadError(
                        f"The adapter in {path} needs its base model {base}, which could not be loaded: "
                        f"{_one_line(err)}"
                    ) from err
                model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
                tokenizer_dir = path if _has_tokenizer(path) else Path(str(base))
            else:
                model = model_class(AutoConfig.from_pretrained(str(path))).from_pretrained(
                    str(path), dtype=torch_dtype
                )
                tokenizer_dir = path
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except ModelLoadError:
            raise
        except Exception as err:
            raise ModelLoadError(f"Could not load the model in {path}: {_one_line(err)}") from err

        model = model.to(device).eval()
        parameters = sum(p.numel() for p in model.parameters())
        if quantize == "int8":
            model = quantize_int8(model)
        engine = cls(model, tokenizer, name=str(path))
        engine.info = {
            "path": str(path),
            "kind": "base + adapter" if found["kind"] == "adapter" else "model",
            "base": str(found["base"]) if found["base"] else None,
            "parameters": parameters,
            "dtype": dtype,
            "quantize": quantize,
            "load_seconds": round(time.perf_counter() - started, 2),
        }
        return engine

    def describe(self) -> str:
        """One line saying which model is loaded, for the UI."""
        info = self.info
        parts = [self.name]  # the name it is served under (a run's model: its id, not the server's folder)
        if info.get("kind") == "base + adapter":
            parts.append(f"adapter on {info.get('base')}")
        if info.get("parameters"):
            parts.append(f"{info['parameters'] / 1e6:.1f}M parameters")
        precision = info.get("dtype", "fp32") + (" + int8 linear" if info.get("quantize") == "int8" else "")
        parts.append(precision)
        parts.append(f"context window {self.max_input_length} tokens")
        return " · ".join(parts)

    # ---- context ---------------------------------------------------------------------------------------------

    def default_settings(self) -> GenerationSettings:
        """The model's generation defaults (BlenderBot's: 10 beams, 19-59 new tokens)."""
        settings = GenerationSettings.from_generation_config(self.generation_config, self.family == "seq2seq")
        return settings.replace(max_new_tokens=min(settings.max_new_tokens, self.max_positions - 1))

    def encode(self, request: Request) -> list[int]:
        """Model input ids of ``request``'s chat, left-truncated to the model's window: the header and the newest
        turns stay."""
        mode = normalize_mode(request.mode)
        return encode_history(
            self.tokenizer, request.turns(), mode, request.context, self.max_input_length, self.family
        )

    def model_input_text(self, request: Request) -> str:
        """What the model sees of ``request``, as text (after truncation)."""
        return self.tokenizer.decode(self.encode(request), skip_special_tokens=False)

    # ---- generation ------------------------------------------------------------------------------------------

    def _generation_config(self, settings: GenerationSettings):
        config = copy.deepcopy(self.generation_config)
        max_new = max(1, min(int(settings.max_new_tokens), self.max_positions - 1))
        min_new = max(0, min(int(settings.min_new_tokens), max_new))
        beams = max(1, int(settings.num_beams))
        # an encoder-decoder's max_length / min_length count decoder tokens, the start token included; setting them
        # (rather than max_new_tokens) overrides BlenderBot's own values without transformers' "both set" warning.
        # A decoder-only model's count the prompt as well, so it gets the new-token limits.
        if self.family == "seq2seq":
            lengths = dict(max_length=max_new + 1, min_length=min_new + 1, max_new_tokens=None, min_new_tokens=None)
        else:
            lengths = dict(max_new_tokens=max_new, min_new_tokens=min_new)
        update = dict(num_beams=beams, do_sample=bool(settings.do_sample), **lengths)
        if settings.do_sample:
            update.update(temperature=float(settings.temperature), top_p=float(settings.top_p))
        if beams == 1:
            update.update(length_penalty=1.0, early_stopping=False)  # beam-only flags
        config.update(**update)
        return config

    def _settings(self, request: Request) -> GenerationSettings:
        """The request's settings, else the model's defaults."""
        return request.settings or self.default_settings()

    def _prepare(self, request: Request):
        """What ``generate`` takes for ``request``: the inputs, the generation config and the logits processors of
        its sampling."""
        ids = self.encode(request)
        device = next(self.model.parameters(), torch.empty(0)).device
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        config = self._generation_config(self._settings(request))
        processors = sampling_processors(request.sampling, config, self._prompt_length(inputs))
        return inputs, config, processors

    def reply(self, request: Request) -> Reply:
        """The bot's reply to ``request`` (:meth:`chat_e.engines.base.ChatEngine.reply`).

        The engine trusts its inputs: text is passed to the model as given (neither cleaned nor cut here; what is
        over the model's window is cut by :mod:`chat_e.data.dialogue`, oldest turns first). A server hands it what
        :func:`chat_e.data.limits.check_request` made of a request; other callers give plain turns likewise: the
        message one turn, non-empty; the history's turns oldest first, speakers alternating, the bot's last; a mode
        :func:`chat_e.data.dialogue.normalize_mode` takes (another name is a ``ValueError``).
        """
        inputs, config, processors = self._prepare(request)
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=config, logits_processor=processors)
        new_tokens = self._new_tokens(out[0], inputs)
        text = "".join(stripped_pieces([self.tokenizer.decode(new_tokens, skip_special_tokens=True)]))
        self._log(inputs, len(new_tokens), started, request.mode)
        return self._finished(text, inputs, new_tokens, config)

    def _finished(self, text: str, inputs, new_tokens, config) -> Reply:
        """The reply: "length" when it ran to its limit without the model's end token; the token counts of the
        prompt and of the reply (its end token not counted)."""
        ends = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        limit = config.max_new_tokens if self.family != "seq2seq" else config.max_length - 1
        ended = len(new_tokens) > 0 and int(new_tokens[-1]) in ends
        return Reply(
            text=text,
            model=self.name,
            finish_reason=LENGTH if not ended and len(new_tokens) >= limit else STOP,
            tokens=len(new_tokens) - int(ended),
            prompt_tokens=int(inputs["input_ids"].shape[-1]),
        )

    def _prompt_length(self, inputs) -> int:
        """Where the reply starts in what ``generate`` passes its logits processors: after the decoder start token,
        or after a decoder-only prompt."""
        return 1 if self.family == "seq2seq" else int(inputs["input_ids"].shape[-1])

    def _new_tokens(self, sequence, inputs):
        """The generated part of ``sequence``: after the decoder start token, or after a decoder-only prompt."""
        return sequence[1:] if self.family == "seq2seq" else sequence[inputs["input_ids"].shape[-1] :]

    def stream(self, request: Request) -> ReplyStream:
        """The reply in pieces as it is generated; their concatenation is :meth:`reply`'s text.

        Beam search cannot stream (the best beam is only known at the end): with ``num_beams > 1`` the whole reply
        comes as one piece. Closing the stream early stops generation.
        """
        return ReplyStream(self._pieces(request), self.name)

    def _pieces(self, request: Request) -> Generator[str, None, Reply]:
        if self._settings(request).num_beams > 1:
            whole = self.reply(request)
            with contextlib.suppress(StopReply):
                yield whole.text
            return whole
        inputs, config, processors = self._prepare(request)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        cancel = threading.Event()
        failure: list[BaseException] = []
        generated: list = []

        def run():
            try:
                with torch.inference_mode():
                    out = self.model.generate(
                        **inputs,
                        generation_config=config,
                        logits_processor=processors,
                        streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]),
                    )
                generated.append(self._new_tokens(out[0], inputs))
            except BaseException as err:  # handed to the reading thread, which re-raises it
                failure.append(err)
                streamer.end()

        started = time.perf_counter()
        worker = threading.Thread(target=run, name="chat-e-generate", daemon=True)
        worker.start()
        text = ""
        try:
            for piece in stripped_pieces(streamer):
                text += piece
                yield piece
        except StopReply:
            pass  # the reader stopped the reply: what was generated so far is the reply
        finally:
            cancel.set()
            worker.join()
        if failure:
            raise failure[0]
        self._log(inputs, len(generated[0]), started, request.mode)
        return self._finished(text, inputs, generated[0], config)

    def _log(self, inputs, new_tokens: int, started: float, mode: str) -> None:
        logger.info(
            "generate: mode=%s input_tokens=%d new_tokens=%d seconds=%.3f",
            normalize_mode(mode),
            inputs["input_ids"].shape[-1],
            new_tokens,
            time.perf_counter() - started,
        )


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
