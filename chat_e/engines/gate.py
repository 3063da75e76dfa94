"""One limit on the replies generated at once (``chat-e --concurrency``), for the UI and the API alike.

The Gradio queue bounds the UI's own events; the OpenAI-compatible API runs beside it. Both reach the model through
one :class:`GatedEngine`, whose slots are the one limit on generation: a reply holds a slot from its first token to
its last (a streamed one until its stream is closed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ..data.settings import GenerationSettings
from .base import ChatEngine

#: what a caller is told when too many wait for a slot (and the server's full queue answers)
BUSY = "Chat-E is busy: too many requests are waiting for a reply. Try again in a moment."


class Busy(RuntimeError):
    """More callers wait for a slot than the caller allowed."""


class GatedEngine(ChatEngine):
    """``engine`` (any :class:`~chat_e.engines.base.ChatEngine`) whose ``chat`` and ``stream_chat`` run at most
    ``concurrency`` at a time; its name, window, description and defaults are the engine's.

    Args:
        engine: the engine behind the gate.
        concurrency: replies generated at the same time.
    """

    def __init__(self, engine, concurrency: int):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        self.engine = engine
        self.concurrency = int(concurrency)
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self.waiting = 0

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def max_positions(self) -> int:
        return self.engine.max_positions

    @property
    def info(self) -> dict[str, Any]:
        return self.engine.info

    def describe(self) -> str:
        return self.engine.describe()

    def default_settings(self) -> GenerationSettings:
        return self.engine.default_settings()

    @contextlib.contextmanager
    def slot(self, max_waiting: int | None = None) -> Iterator[None]:
        """Hold one of the slots (waiting for it); :class:`Busy` at once when ``max_waiting`` callers already
        wait."""
        with self._lock:
            if max_waiting is not None and self.waiting >= max_waiting:
                raise Busy(BUSY)
            self.waiting += 1
        try:
            self._slots.acquire()
        finally:
            with self._lock:
                self.waiting -= 1
        try:
            yield
        finally:
            self._slots.release()

    def chat(self, *args, max_waiting: int | None = None, **kwargs) -> str:
        """The engine's ``chat`` in a slot (``max_waiting``: see :meth:`slot`)."""
        with self.slot(max_waiting):
            return self.engine.chat(*args, **kwargs)

    def stream_chat(self, *args, max_waiting: int | None = None, **kwargs) -> Iterator[str]:
        """The engine's ``stream_chat`` in a slot, taken at the first piece and given back when the stream ends or
        is closed (closing it stops generation)."""
        with self.slot(max_waiting):
            yield from self.engine.stream_chat(*args, **kwargs)
