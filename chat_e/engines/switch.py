"""The served model, swappable while the server runs: the Train page's Promote and Roll back
(:mod:`chat_e.studio.serving`).

A :class:`SwitchableEngine` forwards to the engine it serves now. Each reply takes that engine once, when it starts,
and keeps it to its end: a reply under way when the model is swapped finishes on the model it started on, and its
:class:`~chat_e.data.settings.Reply` names that model, so that the feedback rows and the API's answers name the model
that made the reply. The engine given up by a swap is kept (for Roll back) and freed once
no reply holds it.
"""

from __future__ import annotations

import threading

from .base import ChatEngine, ProxyEngine


class SwitchableEngine(ProxyEngine):
    """The engine served now (any :class:`~chat_e.engines.base.ChatEngine`), which :meth:`swap` replaces; its name,
    window, description and defaults are the current engine's, and each reply is made by the engine current when it
    starts (its :class:`~chat_e.data.settings.Reply` and :class:`~chat_e.engines.base.ReplyStream` name it)."""

    def __init__(self, engine: ChatEngine):
        self._lock = threading.Lock()
        self._engine = engine

    @property
    def target(self) -> ChatEngine:
        """The engine served now."""
        with self._lock:
            return self._engine

    current = target

    def swap(self, engine: ChatEngine) -> ChatEngine:
        """Serve ``engine`` from the next reply on; the engine served until now (replies under way keep it)."""
        with self._lock:
            previous, self._engine = self._engine, engine
        return previous
