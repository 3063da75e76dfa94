"""The served model, swappable while the server runs: the Train page's Promote and Roll back
(:mod:`chat_e.studio.serving`).

A :class:`SwitchableEngine` forwards to the engine it serves now. Each reply takes that engine once, when it starts,
and keeps it to its end: a reply under way when the model is swapped finishes on the model it started on, and its
:class:`~chat_e.data.settings.Completion` names that model (``completion.model``), so that the feedback rows and the
API's answers name the model that made the reply. The engine given up by a swap is kept (for Roll back) and freed once
no reply holds it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from ..data.settings import Completion, GenerationSettings, RequestSampling
from .base import ChatEngine


class SwitchableEngine(ChatEngine):
    """The engine served now (any :class:`~chat_e.engines.base.ChatEngine`), which :meth:`swap` replaces; its name,
    window, description and defaults are the current engine's."""

    def __init__(self, engine: ChatEngine):
        self._lock = threading.Lock()
        self._engine = engine

    @property
    def current(self) -> ChatEngine:
        with self._lock:
            return self._engine

    def swap(self, engine: ChatEngine) -> ChatEngine:
        """Serve ``engine`` from the next reply on; the engine served until now (replies under way keep it)."""
        with self._lock:
            previous, self._engine = self._engine, engine
        return previous

    def _take(self, completion: Completion | None) -> tuple[ChatEngine, Completion]:
        """The engine a reply starts on, and its ``completion`` (a new one when None) naming that engine."""
        engine = self.current
        completion = completion if completion is not None else Completion()
        completion.model = engine.name
        return engine, completion

    @property
    def name(self) -> str:
        return self.current.name

    @property
    def max_positions(self) -> int:
        return self.current.max_positions

    @property
    def info(self) -> dict[str, Any]:
        return self.current.info

    def describe(self) -> str:
        return self.current.describe()

    def default_settings(self) -> GenerationSettings:
        return self.current.default_settings()

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
        """The current engine's ``chat``; ``completion.model`` names it."""
        engine, completion = self._take(completion)
        return engine.chat(message, history, mode, context, settings, completion, sampling, **overrides)

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
        """The current engine's ``stream_chat``, the engine taken when the call is made (before the first piece is
        asked for); ``completion.model`` names it at once."""
        engine, completion = self._take(completion)
        return engine.stream_chat(message, history, mode, context, settings, completion, sampling, **overrides)
