"""The MuDoConv dialogue-context format, in one place.

Training data preparation (:mod:`chat_e.corpora`) and the Chat-E app both build model inputs here, so the two can
never drift apart.

A context (the ``texts`` column of smangrul/MuDoConv) is an optional header, then the turns, oldest first::

    your persona: i've 2 kids. i love flowers. </s>  <s> I like acting. </s> <s> that is ok.  have any kids?
    \\_____________ header ___________________/\\_sep_/\\_ turn _/\\___ join __/\\_______ newest turn ______/

Over-long contexts are truncated on the **left**: the oldest turns go first, the header and the newest turn stay.
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

_HEADER_RE = re.compile(r"^(your persona:|topic:|context:|domain:)")
_TURN_SPLIT_RE = re.compile(r"\s*</s>\s*<s>\s*")


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


def clean_turn(turn: str) -> str:
    """Collapse whitespace so a turn cannot forge separators by accident."""
    return " ".join(str(turn).split())


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
    turns = [clean_turn(t) for t in turns if clean_turn(t)] or [""]
    ids = _encode(tokenizer, join_context(turns, header))
    if max_length is None:
        return [*prefix, *ids, *suffix]
    budget = max_length - len(prefix) - len(suffix)
    if budget <= 0:
        raise ValueError(f"max_length={max_length} leaves no room for text after the special tokens.")
    if len(ids) > budget:
        ids = _truncate_left(tokenizer, turns, header, budget)
    return [*prefix, *ids, *suffix]


def _truncate_left(tokenizer, turns: list[str], header: str, budget: int) -> list[int]:
    # binary search: the largest number k of newest turns that fits (length grows with k)
    lo, hi, best = 1, len(turns) - 1, None
    while lo <= hi:
        k = (lo + hi) // 2
        ids = _encode(tokenizer, join_context(turns[-k:], header))
        if len(ids) <= budget:
            best, lo = ids, k + 1
        else:
            hi = k - 1
    if best is not None:
        return best
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


def encode_texts(tokenizer, texts: str, max_length: int | None = None) -> list[int]:
    """:func:`encode_context` for a raw MuDoConv ``texts`` string."""
    header, turns = parse_texts(texts)
    return encode_context(tokenizer, turns, header, max_length)


def encode_history(
    tokenizer,
    history: Sequence[str],
    mode: str = "none",
    context: str | None = None,
    max_length: int | None = None,
) -> list[int]:
    """Model input ids for a chat: ``history`` is every turn so far (oldest first), the user's newest last."""
    return encode_context(tokenizer, history, make_header(mode, context), max_length)
