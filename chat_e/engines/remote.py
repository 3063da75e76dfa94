"""A remote OpenAI-compatible server (vLLM, ``transformers serve``, another Chat-E) as Chat-E's engine:
``chat-e --backend URL --model NAME``.

:class:`RemoteEngine` has the interface the UI (:mod:`chat_e.web.ui`) and the API (:mod:`chat_e.http.openai_api`) use from
:class:`chat_e.engines.base.ChatEngine`. A chat reaches the remote model as the messages
:func:`chat_e.data.dialogue.chat_messages` makes -- the header of the mode as the system message, the turns alternating
with the user's newest last -- the same messages the embedded decoder-only engine renders with its chat template, so
one rule decides what a chat model sees. The remote server renders them with its own template and generates.

The OpenAI API has no beam search and no minimum reply length: ``num_beams`` and ``min_new_tokens`` do not reach a
remote model (said once in the log). A remote failure (no server, an HTTP error) is a :class:`BackendError` with a
one-line message; the UI apologises and logs that line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Generator, Iterator

from ..data.dialogue import chat_messages, make_header, normalize_mode
from ..data.limits import Request
from ..data.messages import stripped_pieces
from ..data.settings import STOP, GenerationSettings, Reply, RequestSampling
from .base import BackendError, ChatEngine, StopReply, StreamedEngine

logger = logging.getLogger(__name__)

#: environment variable for the remote server's key when ``--backend_api_key`` is not given
BACKEND_API_KEY_ENV = "CHAT_E_BACKEND_API_KEY"
#: what the OpenAI API cannot do, said once when a remote engine starts
UNSUPPORTED = (
    "the OpenAI API has no beam search and no minimum reply length: num_beams and min_new_tokens do not reach the "
    "remote model (replies are greedy with do_sample off, else sampled with temperature and top_p)"
)
#: the longest reply the UI offers for a remote model (its window is not known here)
DEFAULT_MAX_POSITIONS = 4096
#: seconds to wait for the remote server: to connect, and for a whole reply
CONNECT_TIMEOUT, READ_TIMEOUT = 10.0, 600.0


class RemoteEngine(StreamedEngine, ChatEngine):
    """A model served by a remote OpenAI-compatible server, with :class:`~chat_e.engines.base.ChatEngine`'s interface.

    Args:
        base_url: the server's API root, such as ``http://127.0.0.1:8000/v1``.
        model: the remote model's name (as its ``/v1/models`` lists it).
        api_key: the remote server's key (sent as ``Authorization: Bearer KEY``); None: none.
        settings: the generation defaults (:meth:`default_settings`); greedy, 1 beam, 128 new tokens when None.
        max_positions: the model's window in tokens, which bounds a reply's length in the UI.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        settings: GenerationSettings | None = None,
        max_positions: int = DEFAULT_MAX_POSITIONS,
    ):
        import openai  # noqa: PLC0415 (optional extra: app)

        self.base_url = base_url.rstrip("/")
        self.name = model
        self.max_positions = int(max_positions)
        self.max_input_length = self.max_positions
        self.settings = settings or GenerationSettings(
            num_beams=1, do_sample=False, temperature=1.0, top_p=1.0, max_new_tokens=128, min_new_tokens=0
        )
        self.client = openai.OpenAI(
            base_url=self.base_url,
            api_key=api_key or "none",
            max_retries=0,  # a failure is reported at once; the user may send again
            timeout=openai.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),  # the HTTP client's own class
        )
        self.info = {"path": model, "backend": self.base_url}
        logger.info("remote engine %s: %s", self.describe(), UNSUPPORTED)

    def describe(self) -> str:
        """One line saying which model is served, for the UI."""
        return f"{self.name} · served by {self.base_url} (OpenAI-compatible)"

    def default_settings(self) -> GenerationSettings:
        return self.settings

    def messages(self, request: Request) -> list[dict]:
        """The chat messages the remote model gets: :func:`chat_e.data.dialogue.chat_messages` of the request's
        turns under its mode's header."""
        return chat_messages(request.turns(), make_header(normalize_mode(request.mode), request.context))

    def request_fields(self, settings: GenerationSettings, sampling: RequestSampling | None = None) -> dict:
        """The OpenAI request fields for ``settings``: ``max_tokens``, and temperature 0 (greedy) or the sampling
        temperature and top_p; and ``sampling``'s seed and penalties where given (the backend applies them)."""
        fields = {"max_tokens": max(1, min(int(settings.max_new_tokens), self.max_positions - 1))}
        if settings.do_sample:
            fields.update(temperature=float(settings.temperature), top_p=float(settings.top_p))
        else:
            fields["temperature"] = 0.0
        if sampling is not None:
            given = {
                "seed": sampling.seed,
                "presence_penalty": sampling.presence_penalty or None,
                "frequency_penalty": sampling.frequency_penalty or None,
            }
            fields.update({k: v for k, v in given.items() if v is not None})
        return fields

    def _pieces(self, request: Request) -> Generator[str, None, Reply]:
        """The reply in pieces as the remote server streams it (stripped, as the embedded engine's); closing the
        stream closes the remote one. The reply's finish reason is the server's."""
        import openai  # noqa: PLC0415 (optional extra: app)

        fields = self.request_fields(request.settings or self.settings, request.sampling)
        text, finish = "", [STOP]
        try:
            stream = self.client.chat.completions.create(
                model=self.name, messages=self.messages(request), stream=True, **fields
            )
            with stream, contextlib.suppress(StopReply):  # StopReply: the reader stopped the reply
                for piece in stripped_pieces(_contents(stream, finish)):
                    text += piece
                    yield piece
        except openai.APIStatusError as err:
            raise BackendError(f"{self.base_url} answered HTTP {err.status_code}: {_one_line(err.message)}") from None
        except openai.APIError as err:  # no connection, a timeout, a broken stream
            raise BackendError(f"{self.base_url}: {_one_line(str(err))}") from None
        return Reply(text=text, model=self.name, finish_reason=finish[-1])


def _contents(stream, finish: list[str]) -> Iterator[str]:
    """The texts of a chat completion stream's chunks; each finish reason the server gives is appended to
    ``finish``."""
    for chunk in stream:
        for choice in chunk.choices or ():
            if choice.delta and choice.delta.content:
                yield choice.delta.content
            if choice.finish_reason:
                finish.append(choice.finish_reason)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
