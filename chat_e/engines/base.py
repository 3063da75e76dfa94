"""What every Chat-E engine is: the :class:`ChatEngine` protocol the UI and the API talk to, and
:class:`BackendError`, a remote model's failure in one line.

The engines: :class:`chat_e.engines.local.LocalEngine` (a model loaded in this process),
:class:`chat_e.engines.remote.RemoteEngine` (a remote OpenAI-compatible server) and
:class:`chat_e.engines.gate.GatedEngine` (either, with a limit on the replies generated at once).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from ..data.settings import Completion, GenerationSettings, RequestSampling


class BackendError(RuntimeError):
    """The remote server could not be reached or answered with an error; the message is one line."""


@runtime_checkable
class ChatEngine(Protocol):
    """A dialogue model that replies to a chat: the interface of every engine.

    Attributes:
        name: the model's name, as the API's ``/v1/models`` and the feedback rows give it.
        max_positions: the model's window in tokens, which bounds a reply's length in the UI.
        info: what :meth:`describe` tells (the model's path, and more where the engine knows it).
    """

    name: str
    max_positions: int
    info: dict[str, Any]

    def describe(self) -> str:
        """One line saying which model is served, for the UI and the log."""

    def default_settings(self) -> GenerationSettings:
        """The generation settings a reply gets when the caller gives none."""

    def chat(
        self,
        message: str,
        history: Sequence[str] = (),
        mode: str = "none",
        context: str | None = None,
        settings: GenerationSettings | None = None,
        completion: Completion | None = None,
        sampling: RequestSampling | None = None,
        **overrides: Any,
    ) -> str:
        """The reply to ``message`` after ``history`` (plain turns, oldest first, the bot's last) under a context
        ``mode`` (``persona``, ``emotion``, ``domain``, ``topic``, ``none``) with its ``context``. ``settings``
        (:meth:`default_settings` when None; keyword ``overrides`` win); ``completion`` is filled in when the reply
        ends: why it ended and, where the engine counts them, the prompt's and the reply's tokens; ``sampling``: an
        OpenAI request's seed and penalties. The engine trusts its inputs: a server hands it what
        :func:`chat_e.data.limits.check_request` made of a request."""

    def stream_chat(
        self,
        message: str,
        history: Sequence[str] = (),
        mode: str = "none",
        context: str | None = None,
        settings: GenerationSettings | None = None,
        completion: Completion | None = None,
        sampling: RequestSampling | None = None,
        **overrides: Any,
    ) -> Iterator[str]:
        """:meth:`chat`'s reply in pieces as they come (their concatenation is the reply); closing the iterator
        stops generation."""
