"""A chat as the UI and the API carry it, made into the plain turns :class:`chat_e.engines.base.ChatEngine` takes.

A history arrives as ``{"role", "content"}`` messages (the content a string, a ``{"text": ...}`` part or a list of
parts, as Gradio's chat window holds it), ``[user, bot]`` pairs or plain strings, oldest first.
:func:`plain_turn` (the newest message) and :func:`history_turns` (the turns before it) are the one place a chat is
made plain for the model, once per reply (the UI's ``respond`` and the ``chat`` API endpoint reach them through
:func:`chat_e.data.limits.check_request`): every turn's whitespace is collapsed
and it is cut to a length (:data:`MAX_MESSAGE_CHARS` unless the server's limits say otherwise); empty turns and
system messages are dropped, consecutive messages of one speaker are joined into one turn (MuDoConv alternates
speakers), and the newest turns are kept (:data:`MAX_HISTORY_TURNS`, or the limits').

No Gradio here (the limits use it); escaping text for display is the UI's (:mod:`chat_e.web.ui`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .dialogue import clean_turn, without_nul

#: Longest turn (characters) kept by default; :mod:`chat_e.data.limits` passes the server's ``--max_message_chars``.
MAX_MESSAGE_CHARS = 2000
#: Newest turns of a history kept by default; :mod:`chat_e.data.limits` passes the server's ``--max_history_turns``.
MAX_HISTORY_TURNS = 50
#: Who speaks a piece of a history: ``user``, ``assistant``, ``system`` or None (a plain string: turns alternate)
Role = str | None


def message_text(content: Any) -> str:
    """The text of a chat message's content: a string, a ``{"text": ...}`` part, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        return str(content.get("text") or content.get("content") or "") if "file" not in content else ""
    if isinstance(content, Sequence):
        return " ".join(t for t in (message_text(c) for c in content) if t)
    return str(content)


def pieces(item: Any, text: Callable[[Any], str] = message_text) -> list[tuple[Role, str]]:
    """``(role, text)`` of one history item: a ``{"role", "content"}`` message, a ``[user, bot]`` pair (two pieces)
    or a plain string (role None); ``text`` reads a content's text."""
    if isinstance(item, Mapping):
        return [(str(item.get("role") or ""), text(item.get("content")))]
    if isinstance(item, (list, tuple)):
        return [("user", text(item[0]) if item else ""), ("assistant", text(item[1]) if len(item) > 1 else "")]
    return [(None, text(item))]


def plain_turn(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """One turn as the model gets it: whitespace collapsed, cut to ``max_chars``."""
    return clean_turn(text)[:max_chars]


def turns_of(
    history: Iterable[tuple[Role, str]], max_chars: int = MAX_MESSAGE_CHARS, max_turns: int = MAX_HISTORY_TURNS
) -> list[str]:
    """Plain turns, oldest first, from a history's ``(role, text)`` pieces (see the module's docstring): each cut to
    ``max_chars``, the newest ``max_turns`` of them."""
    turns: list[tuple[Role, str]] = []
    for role, text in history:
        text = plain_turn(text, max_chars)
        if role == "system" or not text:
            continue
        if role is not None and turns and turns[-1][0] == role:
            turns[-1] = (role, f"{turns[-1][1]} {text}")
        else:
            turns.append((role, text))
    return [text for _, text in turns[-max_turns:]]


def history_turns(history: Sequence[Any] | None, text: Callable[[Any], str] = message_text) -> list[str]:
    """Plain turns, oldest first, from a history in any of the shapes above (None: none)."""
    return turns_of(piece for item in history or [] for piece in pieces(item, text))


def stripped_pieces(pieces: Iterable[str]) -> Iterator[str]:
    """A streamed reply's pieces as the stripped reply's: no leading whitespace, and trailing whitespace held back
    until more text follows, so that the pieces add up to the whole reply stripped (empty pieces are dropped). NULs
    are dropped (:func:`chat_e.data.dialogue.without_nul`)."""
    pending, first = "", True
    for piece in pieces:
        text = pending + without_nul(piece)
        if first:
            text = text.lstrip()
            first = not text
        body = text.rstrip()
        pending = text[len(body) :]
        if body:
            yield body
