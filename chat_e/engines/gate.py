"""One limit on the replies generated at once (``chat-e --concurrency``), for the UI and the API alike.

The Gradio queue bounds the UI's own events; the OpenAI-compatible API runs beside it. Both reach the model through
one :class:`GatedEngine`, whose slots are the one limit on generation: a reply holds a slot from its first token to
its last (a streamed one until its stream is closed).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..data.limits import Request
from ..data.settings import Reply
from .base import ChatEngine, ProxyEngine, ReplyStream

#: what a caller is told when too many wait for a slot (and the server's full queue answers)
BUSY = "Chat-E is busy: too many requests are waiting for a reply. Try again in a moment."


class Busy(RuntimeError):
    """More callers wait for a slot than the caller allowed."""


class GatedEngine(ProxyEngine):
    """``engine`` (any :class:`~chat_e.engines.base.ChatEngine`) whose replies run at most ``concurrency`` at a time.

    Args:
        engine: the engine behind the gate.
        concurrency: replies generated at the same time.
    """

    def __init__(self, engine: ChatEngine, concurrency: int):
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        self.engine = engine
        self.concurrency = int(concurrency)
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._lock = threading.Lock()
        self.waiting = 0

    @property
    def target(self) -> ChatEngine:
        return self.engine

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

    def reply(self, request: Request, max_waiting: int | None = None) -> Reply:
        """The engine's reply in a slot (``max_waiting``: see :meth:`slot`)."""
        with self.slot(max_waiting):
            return self.engine.reply(request)

    def stream(self, request: Request, max_waiting: int | None = None) -> ReplyStream:
        """The engine's stream in a slot, taken at the first piece and given back when the stream ends or is closed
        (closing it stops generation)."""

        def pieces():
            with self.slot(max_waiting):
                inner = self.engine.stream(request)
                outer.model = inner.model  # the engine behind may have changed while the slot was awaited (a swap)
                return (yield from inner)

        outer = ReplyStream(pieces(), self.engine.name)
        return outer
