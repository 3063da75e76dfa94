"""What every Chat-E engine is: the :class:`ChatEngine` protocol the UI and the API talk to -- a
:class:`~chat_e.data.limits.Request` in, a :class:`~chat_e.data.settings.Reply` out, whole (:meth:`ChatEngine.reply`)
or in pieces (:meth:`ChatEngine.stream`, a :class:`ReplyStream`) -- :class:`ProxyEngine`, the base of the engines that
stand in front of another, and :class:`BackendError`, a remote model's failure in one line.

The engines: :class:`chat_e.engines.local.LocalEngine` (a model loaded in this process),
:class:`chat_e.engines.remote.RemoteEngine` (a remote OpenAI-compatible server); in front of either,
:class:`chat_e.engines.gate.GatedEngine` (a limit on the replies generated at once) and
:class:`chat_e.engines.switch.SwitchableEngine` (the served model, swapped by Promote).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any, Protocol, runtime_checkable

from ..data.limits import Request
from ..data.settings import GenerationSettings, Reply


class BackendError(RuntimeError):
    """The remote server could not be reached or answered with an error; the message is one line."""


class StopReply(Exception):
    """Thrown into an engine's pieces (:meth:`ReplyStream.close`) to end a reply early: the engine stops generating
    and returns the reply made so far."""


class ReplyStream(Iterator[str]):
    """A reply in pieces as they are generated: iterating it gives the pieces (their concatenation is the reply's
    text); once they are all read, :attr:`reply` is the :class:`~chat_e.data.settings.Reply`. :attr:`model` names
    the model making it from the start. Closing it stops generation; :attr:`reply` is then the reply so far (the
    token counts of what was generated), where the engine gives it.

    Args:
        pieces: a generator of the pieces that returns the reply, and returns it early on :class:`StopReply`.
        model: the name of the model that makes it.
    """

    def __init__(self, pieces: Generator[str, None, Reply], model: str):
        self._pieces = pieces
        self.model = model
        #: the reply, once the stream has ended (None before, and when it failed)
        self.reply: Reply | None = None

    def __next__(self) -> str:
        return self._ended(self._pieces.__next__)

    def throw(self, error: BaseException) -> str:
        """Raise ``error`` where the engine's pieces wait (so that a ``yield from`` a stream passes it on)."""
        return self._ended(self._pieces.throw, error)

    def _ended(self, step, *args) -> str:
        try:
            return step(*args)
        except StopIteration as end:
            self.reply = end.value
            raise

    def close(self) -> None:
        if self.reply is None:
            try:
                self.throw(StopReply())
            except (StopIteration, StopReply):
                pass
        self._pieces.close()


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
        """The generation settings a reply gets when the request gives none."""

    def reply(self, request: Request) -> Reply:
        """The reply to ``request``'s message after its history, under its mode and context, made with its settings
        (:meth:`default_settings` when None) and sampling. The engine trusts the request: a server hands it what
        :func:`chat_e.data.limits.check_request` made of what it was sent."""

    def stream(self, request: Request) -> ReplyStream:
        """:meth:`reply`'s reply in pieces as they come; closing the stream stops generation."""


class StreamedEngine:
    """An engine whose pieces are its only way of replying: :meth:`stream` wraps the subclass's ``_pieces(request)``
    (a generator of the pieces returning the :class:`~chat_e.data.settings.Reply`), and :meth:`reply` is the stream
    read to its end."""

    def reply(self, request: Request) -> Reply:
        stream = self.stream(request)
        for _ in stream:
            pass
        return stream.reply

    def stream(self, request: Request) -> ReplyStream:
        return ReplyStream(self._pieces(request), self.name)


class ProxyEngine(ChatEngine):
    """An engine in front of another (:attr:`target`): its name, window, description and defaults are the target's,
    and so are its replies unless a subclass adds something."""

    @property
    def target(self) -> ChatEngine:
        raise NotImplementedError

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def max_positions(self) -> int:
        return self.target.max_positions

    @property
    def info(self) -> dict[str, Any]:
        return self.target.info

    def describe(self) -> str:
        return self.target.describe()

    def default_settings(self) -> GenerationSettings:
        return self.target.default_settings()

    def reply(self, request: Request) -> Reply:
        return self.target.reply(request)

    def stream(self, request: Request) -> ReplyStream:
        return self.target.stream(request)
