"""How a dialogue (mode, context, turns) becomes model input, for both model families, in one place.

Training data preparation (:mod:`chat_e.data.corpora`) and the Chat-E app both build model inputs here, so the two can
never drift apart. Each family has one rendering:

* ``seq2seq`` (BlenderBot): the MuDoConv string below, encoded by the tokenizer; the reply is the decoder's target.
* ``causal`` (chat models such as SmolLM2-135M-Instruct): the tokenizer's own chat template. The header becomes the
  system message (``your persona: ...``, ``topic: ...``, ``context: ...``, ``domain: ...``; free chat has none, so
  the template's default system prompt applies), the turns alternate user/assistant with the newest one the user's,
  and the template's generation prompt ends the input. In training the reply follows as the assistant message and is
  the only part with a loss (:func:`encode_example`).

A context (the ``texts`` column of smangrul/MuDoConv) is an optional header, then the turns, oldest first::

    your persona: i've 2 kids. i love flowers. </s>  <s> I like acting. </s> <s> that is ok.  have any kids?
    \\_____________ header ___________________/\\_sep_/\\_ turn _/\\___ join __/\\_______ newest turn ______/

Over-long contexts are truncated on the **left** in both families: the oldest turns go first, the header and the
newest turn stay.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

TURN_JOIN = " </s> <s> "
HEADER_JOIN = "  <s> "

#: mode -> header template. ``none`` (free chat) has no header.
HEADER_TEMPLATES: dict[str, str] = {
    "persona": "your persona: {} </s>",
    "topic": "topic: {}",
    "emotion": "context: {}",
    "domain": "domain: {}",
}
MODES: tuple[str, ...] = (*HEADER_TEMPLATES, "none")
#: the UI's and the API's names of the modes that differ from :data:`MODES`' (free chat has no header)
MODE_ALIASES: dict[str, str] = {"free": "none", "": "none"}
#: model families: an encoder-decoder gets the MuDoConv string, a decoder-only model its chat template
FAMILIES: tuple[str, ...] = ("seq2seq", "causal")
#: label id that the loss ignores (transformers' convention)
IGNORE_INDEX = -100

_HEADER_RE = re.compile(r"^(your persona:|topic:|context:|domain:)")
_TURN_SPLIT_RE = re.compile(r"\s*</s>\s*<s>\s*")


def normalize_mode(mode: str | None) -> str:
    """A UI or API mode name (``persona``, ``emotion``, ``domain``, ``topic``, ``free``/``none``, any case) -> one of
    :data:`MODES`, the names :class:`chat_e.engines.base.ChatEngine` and :func:`make_header` take."""
    mode = (mode or "").strip().lower()
    mode = MODE_ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"Unknown context mode {mode!r}; choose one of persona, emotion, domain, topic or free.")
    return mode


def make_header(mode: str = "none", context: str | None = None) -> str:
    """The header line for a context ``mode`` (``persona``, ``topic``, ``emotion``, ``domain`` or ``none``)."""
    if mode not in MODES:
        raise ValueError(f"Unknown dialogue mode {mode!r}; choose one of {', '.join(MODES)}.")
    context = " ".join((context or "").split())
    if mode == "none" or not context:
        return ""
    return HEADER_TEMPLATES[mode].format(context)


def parse_header(header: str) -> tuple[str, str | None]:
    """``(mode, context)`` of a MuDoConv header line: the inverse of :func:`make_header`."""
    for mode, template in HEADER_TEMPLATES.items():
        prefix, suffix = template.split("{}")
        if header and header.startswith(prefix) and header.endswith(suffix):
            return mode, header[len(prefix) : len(header) - len(suffix)].strip()
    return "none", None


def without_nul(text: str) -> str:
    """``text`` without NUL characters, which every text Chat-E keeps goes through (a user's, a model's): they show
    as nothing, and PostgreSQL's text columns cannot hold them (a random-init model's byte tokens decode to them)."""
    return text.replace("\x00", "")


def clean_turn(turn: str) -> str:
    """Collapse whitespace so a turn cannot forge separators by accident (and drop NULs: :func:`without_nul`)."""
    return " ".join(without_nul(str(turn)).split())


def join_context(turns: Sequence[str], header: str = "") -> str:
    """Header + turns in MuDoConv's string format (no truncation)."""
    body = TURN_JOIN.join(clean_turn(t) for t in turns)
    if not header:
        return body
    return header + HEADER_JOIN + body


def format_context(turns: Sequence[str], mode: str = "none", context: str | None = None) -> str:
    """MuDoConv ``texts`` for ``turns`` (oldest first) under a context ``mode``."""
    return join_context(turns, make_header(mode, context))


def parse_texts(texts: str) -> tuple[str, list[str]]:
    """Split a MuDoConv ``texts`` string into ``(header, turns)``; the inverse of :func:`join_context`."""
    header, body = "", texts.strip()
    if _HEADER_RE.match(body) and "<s>" in body:
        idx = body.index("<s>")
        header, body = body[:idx].strip(), body[idx + len("<s>") :]
    turns = (t.strip() for t in _TURN_SPLIT_RE.split(body))
    return header, [t for t in turns if t]


@lru_cache(maxsize=16)
def _special_affixes(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a tokenizer adds around a single sequence (BlenderBot: none before, ``</s>`` after)."""
    bare = tokenizer("hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return tuple(full[:start]), tuple(full[start + len(bare) :])
    return (), ()


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def encode_context(
    tokenizer,
    turns: Sequence[str],
    header: str = "",
    max_length: int | None = None,
) -> list[int]:
    """Token ids (with the tokenizer's special tokens) for ``header`` + ``turns``, at most ``max_length`` long.

    Truncation is on the left and turn-aware: whole oldest turns are dropped first; if the newest turn alone (with
    the header) is still too long, its oldest tokens are cut. The header is kept (cut to half the budget at most).
    """
    prefix, suffix = _special_affixes(tokenizer)
    turns = [t for t in map(clean_turn, turns) if t] or [""]
    ids = _encode(tokenizer, join_context(turns, header))
    if max_length is None:
        return [*prefix, *ids, *suffix]
    budget = max_length - len(prefix) - len(suffix)
    if budget <= 0:
        raise ValueError(f"max_length={max_length} leaves no room for text after the special tokens.")
    if len(ids) > budget:
        ids = _truncate_left(tokenizer, turns, header, budget)
    return [*prefix, *ids, *suffix]


def _newest_turns_that_fit(encode_newest, n_turns: int, budget: int) -> tuple[int, list[int]] | None:
    """``(k, ids)`` of the most newest turns ``k`` that fit ``budget`` (``encode_newest(k)`` encodes the ``k`` newest),
    or None when even the newest alone is too long. A binary search: the length grows with ``k``."""
    lo, hi, best = 1, n_turns - 1, None
    while lo <= hi:
        k = (lo + hi) // 2
        ids = encode_newest(k)
        if len(ids) <= budget:
            best, lo = (k, ids), k + 1
        else:
            hi = k - 1
    return best


def _truncate_left(tokenizer, turns: list[str], header: str, budget: int) -> list[int]:
    best = _newest_turns_that_fit(lambda k: _encode(tokenizer, join_context(turns[-k:], header)), len(turns), budget)
    if best is not None:
        return best[1]
    # the newest turn alone does not fit: keep the header (at most half the budget) and the newest tokens
    newest = _encode(tokenizer, join_context(turns[-1:], header))
    if not header:
        return newest[-budget:]
    head = _encode(tokenizer, header + HEADER_JOIN.rstrip())
    if newest[: len(head)] != head:  # tokenizer merged across the separator; fall back to plain left truncation
        return newest[-budget:]
    tail = newest[len(head) :]
    head = head[: max(budget // 2, budget - len(tail))]
    return head + tail[len(tail) - (budget - len(head)) :]


# ---------------------------------------------------------------------------------------------- chat templates
def family_of(config) -> str:
    """``seq2seq`` for an encoder-decoder model config, ``causal`` for a decoder-only one."""
    return "seq2seq" if getattr(config, "is_encoder_decoder", False) else "causal"


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"Unknown model family {family!r}; choose one of {', '.join(FAMILIES)}.")


def system_message(header: str) -> str:
    """The system message for a MuDoConv header: its words without MuDoConv's ``</s>`` separator."""
    return header.strip().removesuffix("</s>").strip()


def parse_system_message(text: str) -> tuple[str, str | None]:
    """``(mode, context)`` of a system message in the form :func:`system_message` makes of a header (``your
    persona: ...``, ``topic: ...``, ``context: ...``, ``domain: ...``), or of a header itself; ``("none", None)`` for
    any other text. The inverse of ``system_message(make_header(mode, context))``."""
    text = " ".join((text or "").split())
    mode, context = parse_header(text)
    if mode != "none":
        return mode, context
    for mode, template in HEADER_TEMPLATES.items():
        prefix, suffix = system_message(template).split("{}")
        if len(text) > len(prefix) + len(suffix) and text.startswith(prefix) and text.endswith(suffix):
            return mode, text[len(prefix) : len(text) - len(suffix)].strip()
    return "none", None


def chat_messages(turns: Sequence[str], header: str = "", reply: str | None = None) -> list[dict]:
    """Chat-template messages: the header as the system message, then the turns alternating so that the newest is
    the user's, then ``reply`` as the assistant's when given."""
    messages = [{"role": "system", "content": system_message(header)}] if system_message(header) else []
    for i, turn in enumerate(turns):
        role = "user" if (len(turns) - 1 - i) % 2 == 0 else "assistant"
        messages.append({"role": role, "content": clean_turn(turn)})
    if reply is not None:
        messages.append({"role": "assistant", "content": clean_turn(reply)})
    return messages


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer of {getattr(tokenizer, 'name_or_path', 'this model')!r} has no chat template, which a "
            "decoder-only dialogue model needs; use an instruct/chat checkpoint or set tokenizer.chat_template."
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode_chat_prompt(tokenizer, turns: Sequence[str], header: str = "", max_length: int | None = None) -> list[int]:
    """Chat-template prompt ids (ending with the generation prompt) for ``header`` + ``turns``, at most
    ``max_length`` long, truncated on the left like :func:`encode_context`: whole oldest turns first; then the
    header's end (it keeps at most half the budget) and the newest turn's oldest tokens."""
    turns = [t for t in map(clean_turn, turns) if t] or [""]

    def encode(kept: Sequence[str], head: str) -> list[int]:
        return _encode(tokenizer, _render(tokenizer, chat_messages(kept, head), add_generation_prompt=True))

    ids = encode(turns, header)
    if max_length is None or len(ids) <= max_length:
        return ids
    best = _newest_turns_that_fit(lambda k: encode(turns[-k:], header), len(turns), max_length)
    if best is not None:
        return best[1]
    head_ids = _encode(tokenizer, system_message(header))
    if len(head_ids) > max_length // 2:  # the header keeps its start, at most half the budget
        header = tokenizer.decode(head_ids[: max_length // 2])
    room = max_length - len(encode([""], header))
    if room <= 0:
        raise ValueError(f"max_length={max_length} leaves no room for a message after the chat template's tokens.")
    newest = _encode(tokenizer, turns[-1])
    for _ in range(8):  # decoding a cut and encoding it again can add a token; shrink until it fits
        ids = encode([tokenizer.decode(newest[-room:]) if room > 0 else ""], header)
        if len(ids) <= max_length:
            return ids
        room -= len(ids) - max_length
    return ids[-max_length:]


def chat_turns_that_fit(tokenizer, turns: Sequence[str], header: str = "", max_length: int | None = None) -> list[str]:
    """The newest whole ``turns`` (cleaned) whose chat-template prompt fits ``max_length`` tokens, as
    :func:`encode_chat_prompt` keeps them before it cuts inside a turn: the newest alone when even it is longer.
    For rows kept as messages (TRL's conversational format), which the trainer renders itself."""
    turns = [t for t in map(clean_turn, turns) if t] or [""]

    def encode_newest(k: int) -> list[int]:
        return _encode(tokenizer, _render(tokenizer, chat_messages(turns[-k:], header), add_generation_prompt=True))

    if max_length is None or len(encode_newest(len(turns))) <= max_length:
        return turns
    best = _newest_turns_that_fit(encode_newest, len(turns), max_length)
    return turns[-best[0] :] if best is not None else turns[-1:]


def chat_reply_ids(tokenizer, reply: str, max_length: int | None = None) -> list[int]:
    """The tokens a chat model should generate after the generation prompt for ``reply``: what the template writes
    for an assistant message, up to and including the end-of-turn token (the tokenizer's eos)."""
    probe = [{"role": "user", "content": "hello"}]
    prompt = _render(tokenizer, probe, add_generation_prompt=True)
    full = _render(
        tokenizer, [*probe, {"role": "assistant", "content": clean_turn(reply)}], add_generation_prompt=False
    )
    if not full.startswith(prompt):
        raise ValueError(
            "The chat template does not render an assistant reply after its generation prompt; replies cannot be "
            "told apart from the prompt for the loss mask."
        )
    ids = _encode(tokenizer, full[len(prompt) :])
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos) + 1]
    if max_length is not None and len(ids) > max_length:
        ids = ids[: max_length - 1] + ([eos] if eos is not None else ids[max_length - 1 : max_length])
    return ids


# ---------------------------------------------------------------------------------------------- both families
def encode_texts(tokenizer, texts: str, max_length: int | None = None, family: str = "seq2seq") -> list[int]:
    """Model input ids for a raw MuDoConv ``texts`` string in the rendering of ``family``."""
    header, turns = parse_texts(texts)
    return encode_turns(tokenizer, turns, header, max_length, family)


def encode_turns(
    tokenizer, turns: Sequence[str], header: str = "", max_length: int | None = None, family: str = "seq2seq"
) -> list[int]:
    """Model input ids for ``header`` + ``turns`` (oldest first): the one dispatch between the two renderings."""
    _check_family(family)
    if family == "causal":
        return encode_chat_prompt(tokenizer, turns, header, max_length)
    return encode_context(tokenizer, turns, header, max_length)


def encode_history(
    tokenizer,
    history: Sequence[str],
    mode: str = "none",
    context: str | None = None,
    max_length: int | None = None,
    family: str = "seq2seq",
) -> list[int]:
    """Model input ids for a chat: ``history`` is every turn so far (oldest first), the user's newest last."""
    return encode_turns(tokenizer, history, make_header(mode, context), max_length, family)


def encode_example(
    tokenizer,
    texts: str,
    reply: str,
    max_source_length: int | None,
    max_target_length: int | None,
    family: str = "seq2seq",
) -> dict[str, list[int]]:
    """A training example: ``input_ids``, ``attention_mask`` and ``labels``.

    ``seq2seq``: the encoded context, and the reply's ids (ending in ``</s>``) as labels. ``causal``: the prompt
    followed by the reply's ids; labels are :data:`IGNORE_INDEX` over the prompt, so the loss is on the reply only
    (and the prompt of an eval row is everything before its first label).
    """
    _check_family(family)
    if family == "causal":
        header, turns = parse_texts(texts)
        prompt = encode_chat_prompt(tokenizer, turns, header, max_source_length)
        completion = chat_reply_ids(tokenizer, reply, max_target_length)
        input_ids = prompt + completion
        labels = [IGNORE_INDEX] * len(prompt) + completion
    else:
        input_ids = encode_texts(tokenizer, texts, max_source_length)
        kwargs = {"max_length": max_target_length, "truncation": True} if max_target_length else {}
        labels = tokenizer(text_target=reply, **kwargs)["input_ids"]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}
