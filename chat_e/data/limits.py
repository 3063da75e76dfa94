"""What one Chat-E request may carry, checked once at the edge -- every UI event and the ``chat`` API endpoint call
:func:`check_request` before anything is tokenized -- so that no request costs more than the limits allow.

No Gradio here: a refusal is a :class:`Refused` whose message says what to change; the UI turns it into a
``gr.Error`` (a notice in the browser, an ``AppError`` with the same text for ``gradio_client``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .dialogue import normalize_mode, without_nul
from .messages import MAX_HISTORY_TURNS, MAX_MESSAGE_CHARS, Role, message_text, pieces, plain_turn, turns_of
from .settings import SETTINGS, GenerationSettings, RequestSampling, setting_type

#: roles of a ``{"role", "content"}`` history message
ROLES = ("user", "assistant", "system")
#: the JSON bytes one character of a request can take (``\\uXXXX``), for the body-size floor
JSON_BYTES_PER_CHAR = 6
#: room in a request body for everything besides the texts (field names, settings, session ids)
BODY_OVERHEAD_BYTES = 16 * 1024
_UNSET: Any = object()


class Refused(ValueError):
    """A request outside :class:`ChatLimits`, or a malformed one; the message says what to change. ``setting``: the
    generation setting it is about (the message starts with its name), for callers that name it otherwise."""

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(message)
        self.setting = setting


@dataclass
class ChatLimits:
    """What a request may carry and how many may wait; each field is a ``chat-e`` flag of the same name."""

    # ---- one request's fields (characters are counted before anything is tokenized)
    max_message_chars: int = field(
        default=MAX_MESSAGE_CHARS, metadata={"help": "Longest message in characters; a longer one is refused."}
    )
    max_context_chars: int = field(
        default=4000, metadata={"help": "Longest persona / emotion / domain / topic context in characters."}
    )
    max_history_turns: int = field(
        default=MAX_HISTORY_TURNS,
        metadata={"help": "Most earlier messages in a chat (a [user, bot] pair counts 2); a longer chat is refused."},
    )
    max_history_chars: int = field(
        default=20_000, metadata={"help": "Most characters in a chat's earlier messages together."}
    )
    # ---- the server
    max_body_bytes: int = field(
        default=1 << 20,
        metadata={"help": "Largest request body in bytes (uploads included); a bigger one gets HTTP 413 unread."},
    )
    max_queue: int = field(
        default=64,
        metadata={"help": "Requests that may wait for a reply; beyond them callers are told Chat-E is busy."},
    )
    max_sessions: int = field(
        default=1000,
        metadata={
            "help": "Sessions (browser tabs, API clients) whose state the server keeps; beyond them the oldest is "
            "dropped. Each holds memory until dropped (a copy of the app's configuration)."
        },
    )

    def __post_init__(self):
        problems = [
            f"--{f.name} must be at least 1 (got {getattr(self, f.name)})."
            for f in fields(self)
            if not (isinstance(getattr(self, f.name), int) and getattr(self, f.name) >= 1)
        ]
        if problems:
            raise ValueError(" ".join(problems))
        needed = self.largest_request_bytes()
        if self.max_body_bytes < needed:
            raise ValueError(
                f"--max_body_bytes {self.max_body_bytes:,} is too small for a request within the other limits (up "
                f"to {needed:,} bytes of JSON): raise it, or lower --max_history_chars / --max_context_chars / "
                "--max_message_chars."
            )

    def largest_request_bytes(self) -> int:
        """The body of the largest request within the text limits: every character escaped in JSON."""
        chars = self.max_message_chars + self.max_context_chars + self.max_history_chars
        return JSON_BYTES_PER_CHAR * chars + BODY_OVERHEAD_BYTES


@dataclass(frozen=True)
class Request:
    """One chat request as every engine takes it (:meth:`chat_e.engines.base.ChatEngine.reply`): the user's newest
    ``message`` (one plain turn), the earlier ``history`` (plain turns, oldest first, speakers alternating, the bot's
    last), a context ``mode`` and its ``context``, the reply's ``settings`` (None: the engine's defaults) and an
    OpenAI request's ``sampling`` (seed and penalties; None: none).

    :func:`check_request` makes one of what a caller sent (the UI's events, the APIs), within the limits; the engine
    trusts it. Other callers (the evaluation, benchmarks) build one directly from plain turns."""

    message: str | None = None
    history: tuple[str, ...] | list[str] = ()
    mode: str = "none"
    context: str | None = None
    settings: GenerationSettings | None = None
    sampling: RequestSampling | None = None

    def turns(self) -> list[str]:
        """All turns so far, oldest first, with the message (the user's newest) last (none when it is empty)."""
        return [*self.history, self.message] if self.message else list(self.history)

    def but(self, **fields: Any) -> Request:
        """This request with ``fields`` replaced."""
        return replace(self, **fields)


def check_request(
    limits: ChatLimits,
    *,
    message: Any = _UNSET,
    history: Any = _UNSET,
    chat: Any = _UNSET,
    mode: Any = _UNSET,
    context: Any = _UNSET,
    settings: Mapping[str, Any] | None = None,
    defaults: GenerationSettings | None = None,
    ranges: Mapping[str, tuple[float, float]] | None = None,
    sampling: RequestSampling | None = None,
    text: Callable[[Any], str] = message_text,
) -> Request:
    """Check the fields a request carries (those given) against ``limits``, cheapest checks first.

    Args:
        message: the user's newest message: a non-empty string of at most ``max_message_chars``.
        history: earlier messages, oldest first: ``{"role", "content"}`` messages, ``[user, bot]`` pairs or strings;
            at most ``max_history_turns`` of them and ``max_history_chars`` characters together (None: no history).
        chat: a history of ``{"role", "content"}`` messages only (the chat window's), under the same limits.
        mode: a context mode name (``persona``, ``emotion``, ``domain``, ``topic``, ``free``).
        context: the mode's context: a string of at most ``max_context_chars`` (None: none).
        settings: generation settings by name, each checked against ``ranges[name]`` (``do_sample``: a bool); the
            request's settings are ``defaults`` (:class:`GenerationSettings`' own when None) with these.
        sampling: an OpenAI request's seed and penalties, carried as given (the API checks them).
        text: a history message content's text (the UI passes its display -> typed-text inverse).

    Returns:
        The fields as the engine takes them (it trusts them): the message and the history as plain turns, made so
        here, once per request (:mod:`chat_e.data.messages`' rules); the mode normalized.

    Raises:
        Refused: the first field outside its limit or of the wrong type, with what to change.
    """
    checked: dict[str, Any] = {"sampling": sampling}
    if message is not _UNSET:
        typed = _check_text("message", message, limits.max_message_chars, required=True)
        checked["message"] = plain_turn(typed, limits.max_message_chars)
    if context is not _UNSET:
        checked["context"] = _check_text("context", context, limits.max_context_chars, required=False)
    if mode is not _UNSET:
        checked["mode"] = _check_mode(mode)
    if history is not _UNSET:
        checked["history"] = _check_history(history, limits, text)
    if chat is not _UNSET:
        checked["history"] = _check_history(chat, limits, text, messages_only=True)
    if settings is not None:
        checked["settings"] = (defaults or GenerationSettings()).replace(**_check_settings(settings, ranges or {}))
    return Request(**checked)


def _check_text(name: str, value: Any, limit: int, required: bool) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise Refused(f"The {name} should be text (a string), not {_kind(value)}.")
    if len(value) > limit:
        raise Refused(
            f"The {name} is {len(value):,} characters long; Chat-E takes up to {limit:,}. Shorten it and send again."
        )
    value = without_nul(value)
    if required and not value.strip():
        raise Refused(f"The {name} is empty: type something to send.")
    return value


def _check_mode(mode: Any) -> str:
    if not isinstance(mode, str):
        raise Refused(f"The mode should be a string (persona, emotion, domain, topic or free), not {_kind(mode)}.")
    try:
        return normalize_mode(mode[:32])
    except ValueError as err:
        raise Refused(str(err)) from None


def _check_history(
    history: Any, limits: ChatLimits, text: Callable[[Any], str], messages_only: bool = False
) -> list[str]:
    if history is None:
        return []
    if not isinstance(history, (list, tuple)):
        raise Refused(
            f"The history should be a list of {{'role', 'content'}} messages, oldest first, not {_kind(history)}."
        )
    turns = sum(2 if isinstance(item, (list, tuple)) else 1 for item in history)
    if turns > limits.max_history_turns:
        raise Refused(
            f"The chat has {turns:,} earlier messages; Chat-E takes up to {limits.max_history_turns:,}. Start a new "
            "chat (Clear) or send fewer."
        )
    found: list[tuple[Role, str]] = []
    chars = 0
    for i, item in enumerate(history):
        if isinstance(item, Mapping):
            role = item.get("role")
            if role not in ROLES:
                raise Refused(f"history[{i}]['role'] should be 'user' or 'assistant', not {_kind(role)}.")
            contents = [item.get("content")]
        elif messages_only:
            raise Refused(f"chat[{i}] should be a {{'role', 'content'}} message, not {_kind(item)}.")
        elif isinstance(item, (list, tuple)):
            if len(item) > 2:
                raise Refused(f"history[{i}] should be a [user, bot] pair, not a list of {len(item)}.")
            contents = list(item)
        elif isinstance(item, str):
            contents = [item]
        else:
            raise Refused(
                f"history[{i}] should be a {{'role', 'content'}} message, a [user, bot] pair or a string, not "
                f"{_kind(item)}."
            )
        for content in contents:
            if not (content is None or isinstance(content, (str, list, tuple, Mapping))):
                raise Refused(f"history[{i}] should hold text, not {_kind(content)}.")
        texts = pieces(item, text)
        chars += sum(len(t) for _, t in texts)
        if chars > limits.max_history_chars:
            raise Refused(
                f"The chat's earlier messages are over {limits.max_history_chars:,} characters together, the "
                "most Chat-E takes. Start a new chat (Clear) or send fewer."
            )
        found += texts
    # the turns as checked: none cut beyond the limits (a turn within the chat's characters, the chat's turns)
    return turns_of(found, limits.max_history_chars, limits.max_history_turns)


def _check_settings(settings: Mapping[str, Any], ranges: Mapping[str, tuple[float, float]]) -> dict[str, Any]:
    kinds = {f.name: setting_type(f) for f in SETTINGS}
    checked = {}
    for name, value in settings.items():
        if name not in kinds:
            raise Refused(f"{_kind(name)} is not a generation setting; they are {', '.join(kinds)}.")
        if kinds[name] is bool:
            if not isinstance(value, bool):
                raise Refused(f"{name} should be true or false, not {_kind(value)}.", setting=name)
            checked[name] = value
            continue
        low, high = ranges[name]
        integral = kinds[name] is int
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or not low <= value <= high or (integral and value != int(value)):
            what = "a whole number" if integral else "a number"
            shown = repr(value) if number else _kind(value)
            raise Refused(f"{name} should be {what} from {low} to {high}, not {shown}.", setting=name)
        checked[name] = int(value) if integral else float(value)
    return checked


def _kind(value: Any) -> str:
    """How a refusal names a value of the wrong type: its JSON type, never the (maybe huge) value itself."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else f"a string of {len(value):,} characters"
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        tuple: "a list",
    }
    return "an object" if isinstance(value, Mapping) else names.get(type(value), type(value).__name__)
