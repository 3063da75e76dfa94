"""Chat-E's OpenAI-compatible API, beside its UI: ``GET /v1/models`` and ``POST /v1/chat/completions`` (plain, or
``stream: true`` as server-sent ``chat.completion.chunk`` events ending with ``data: [DONE]``).

A request is bounded exactly as the UI's (:func:`chat_e.data.limits.check_request`, the same refusal texts, as HTTP 400 in
OpenAI's error shape) and generated through the same :class:`chat_e.engines.gate.GatedEngine`, so the UI and the API share
one concurrency limit. The context mode comes from the extra body fields ``mode`` and ``context`` or else from the
system message: one in the form :func:`chat_e.data.dialogue.system_message` makes (``your persona: ...``, ``topic:
...``, ``context: ...`` for an emotion, ``domain: ...``) selects that mode, any other text is a persona, none is free
chat. The API key (``Authorization: Bearer KEY``, as the openai client sends it) is checked by
:class:`chat_e.http.guard.RequestGuard` in front of the whole server.

``stop`` (up to 4 strings) ends a reply before the first of them, with ``finish_reason`` "stop", streamed or not;
``seed`` makes a sampled reply repeatable, ``presence_penalty`` and ``frequency_penalty`` apply as OpenAI defines
them (:mod:`chat_e.engines.sampling`), and ``n`` (up to 8) gives that many choices, generated one after another
(choice ``i`` sampled with ``seed + i``; streamed, each choice's chunks in turn, each naming its index); fields
Chat-E cannot honour (``logit_bias``, ``top_logprobs``, a ``response_format`` other than text, tools, ``logprobs``)
are refused with a 400 naming the field, never ignored.

Every answer is built from the ``openai`` package's own types (``openai.types.chat``: ``ChatCompletion``,
``ChatCompletionChunk``; ``Model``, ``CompletionUsage``, ``ErrorObject``), so that its fields are OpenAI's.

FastAPI (the app extra, with gradio) is imported here: only serving imports this module.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

import anyio
import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.shared import ErrorObject
from starlette.concurrency import run_in_threadpool

from ..data.dialogue import parse_system_message
from ..data.limits import ChatLimits, Refused, check_request
from ..data.limits import Request as ChatRequest
from ..data.messages import message_text
from ..data.settings import PENALTY_RANGE, STOP, GenerationSettings, Reply, RequestSampling, setting_ranges
from ..engines.gate import Busy, GatedEngine

logger = logging.getLogger(__name__)

PREFIX = "/v1"
#: roles whose messages set the context mode (OpenAI's newer name for the system role is ``developer``)
SYSTEM_ROLES = ("system", "developer")


class Message(pydantic.BaseModel):
    """One chat message: its text is a string or a list of text parts."""

    model_config = pydantic.ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(pydantic.BaseModel):
    """OpenAI's chat completion request, with Chat-E's ``mode`` and ``context``; other fields are tolerated."""

    model_config = pydantic.ConfigDict(extra="allow")
    model: str | None = None
    messages: list[Message]
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    logprobs: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    mode: str | None = None
    context: str | None = None

    def stops(self) -> list[str]:
        """The stop strings asked for (none empty), as OpenAI takes them: one string or a list of up to 4."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


#: fields a request may carry that Chat-E cannot honour: field -> (whether the value asks for something, the refusal)
UNHONOURED = {
    "logit_bias": (bool, "Chat-E does not apply logit_bias: send none."),
    "top_logprobs": (lambda v: v not in (None, 0), "Chat-E does not return log probabilities: send no top_logprobs."),
    "response_format": (lambda v: v is not None and v.get("type") != "text",
                        "Chat-E replies in plain text only: send response_format {\"type\": \"text\"} or none."),
}  # fmt: skip
#: OpenAI's limit on the stop strings of one request, and Chat-E's on each one's length (a reply is shorter)
MAX_STOPS, MAX_STOP_CHARS = 4, 200
#: Chat-E's limit on a request's choices (``n``): each is a reply generated in turn
MAX_CHOICES = 8


def request_sampling(request: ChatCompletionRequest) -> RequestSampling:
    """The request's seed and penalties (:class:`chat_e.data.settings.RequestSampling`); a seed outside a 64-bit
    integer's range (OpenAI's, and torch's generator's) or a penalty outside OpenAI's range is refused naming it."""
    if request.seed is not None and not -(2**63) <= request.seed < 2**63:
        raise refusal("seed should be a whole number from -2**63 to 2**63 - 1.", param="seed")
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None and not low <= value <= high:
            raise refusal(f"{name} should be a number from {low:g} to {high:g}.", param=name)
    return RequestSampling(
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
    )


class StopScanner:
    """Cuts a reply at the first of its stop strings, as OpenAI does (the stop string itself left out), piece by
    piece: :meth:`feed` gives what can be shown of the text so far, holding back a tail that could still begin a stop
    string; :meth:`flush` the held-back rest once the reply has ended without one."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped = stops, "", False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.pending += piece
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            shown, self.pending = self.pending[: min(found)], ""
            return shown
        cut = max(0, len(self.pending) - self.hold)
        shown, self.pending = self.pending[:cut], self.pending[cut:]
        return shown

    def flush(self) -> str:
        shown, self.pending = self.pending, ""
        return "" if self.stopped else shown


class APIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        error = ErrorObject(message=self.message, type=self.kind, param=self.param, code=self.code)
        return {"error": wire(error)}


def wire(answer: pydantic.BaseModel) -> dict:
    """An ``openai`` type as JSON: the fields it was given (the types' optional extras left out, as OpenAI does)."""
    return answer.model_dump(mode="json", exclude_unset=True)


def refusal(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


#: the generation settings a request sets, each with the request's fields it comes from (the first given wins)
REQUEST_FIELDS = {
    "max_new_tokens": ("max_completion_tokens", "max_tokens"),
    "temperature": ("temperature",),
    "top_p": ("top_p",),
}


def given_field(request: ChatCompletionRequest, setting: str | None) -> str | None:
    """The request field a generation setting comes from, as the client spelled it (None: not given)."""
    return next((f for f in REQUEST_FIELDS.get(setting or "", ()) if getattr(request, f) is not None), None)


def request_settings(request: ChatCompletionRequest) -> dict[str, Any]:
    """The generation settings a request asks for (the server's defaults keep the rest): ``max_tokens`` /
    ``max_completion_tokens`` the reply's length; ``temperature`` 0 greedy, above 0 sampling at it; ``top_p``
    sampling with it. Either of the last two means one beam (OpenAI has no beam search)."""
    values = {s: getattr(request, f) for s in REQUEST_FIELDS if (f := given_field(request, s))}
    greedy = values.get("temperature") == 0
    settings: dict[str, Any] = {k: v for k, v in values.items() if k == "max_new_tokens" or not greedy}
    if "temperature" in values or "top_p" in values:
        settings.update(num_beams=1, do_sample=not greedy)
    return settings


def split_messages(messages: list[Message]) -> tuple[str, list[dict], Any]:
    """``(system text, earlier messages, the user's newest message's content)``; refused when the last message is
    not the user's or a message holds anything but text."""
    for i, m in enumerate(messages):
        parts = m.content if isinstance(m.content, list) else []
        if any(p.get("type", "text") != "text" for p in parts):
            raise refusal(f"messages[{i}] holds a non-text part; Chat-E takes text only.", param=f"messages[{i}]")
    system = " ".join(message_text(m.content) for m in messages if m.role in SYSTEM_ROLES).strip()
    chat = [m for m in messages if m.role not in SYSTEM_ROLES]
    if not chat or chat[-1].role != "user":
        raise refusal("The last message (after any system message) should be the user's.", param="messages")
    history = [{"role": m.role, "content": m.content} for m in chat[:-1]]
    return system, history, chat[-1].content


def chat_mode(request: ChatCompletionRequest, system: str) -> tuple[str, str]:
    """The request's context mode and context: the ``mode`` / ``context`` fields, else the system message's."""
    if request.mode is not None:
        return request.mode, request.context or ""
    if not system:
        return "free", ""
    mode, context = parse_system_message(system)
    return ("persona", system) if mode == "none" else (mode, context or "")


def openai_router(
    engine: GatedEngine,
    settings: GenerationSettings | None = None,
    limits: ChatLimits | None = None,
    model_id: str | None = None,
) -> APIRouter:
    """The ``/v1`` routes over ``engine`` (shared with the UI, see :mod:`chat_e.engines.gate`): ``settings`` are the
    server's defaults (a request's fields override them), ``limits`` bound every request as the UI's, ``model_id`` is
    the model's name in ``/v1/models`` and the answers (when None: the served model's name, and in an answer the name
    of the model that made it, which a promotion can change between two requests: :mod:`chat_e.engines.switch`)."""
    completions = ChatCompletions(engine, settings, limits, model_id)
    router = APIRouter(prefix=PREFIX)
    router.add_api_route("/models", completions.models, methods=["GET"])
    router.add_api_route("/chat/completions", completions.create, methods=["POST"])
    return router


class ChatCompletions:
    """The API's two routes: ``GET /models`` and ``POST /chat/completions`` (whole, or streamed as server-sent
    events), each request checked once (:meth:`check`) and made a :class:`~chat_e.data.limits.Request` per choice."""

    def __init__(self, engine, settings: GenerationSettings | None, limits: ChatLimits | None, model_id: str | None):
        self.engine = engine if isinstance(engine, GatedEngine) else GatedEngine(engine, concurrency=1)
        self.defaults = settings or self.engine.default_settings()
        self.limits = limits or ChatLimits()
        self.ranges = setting_ranges(self.engine.max_positions - 1)
        self.model_id = model_id
        self.created = int(time.time())

    async def models(self):
        model = Model(id=self.model_id or self.engine.name, object="model", created=self.created, owned_by="chat-e")
        return {"object": "list", "data": [wire(model)]}

    async def create(self, raw: Request):
        try:
            try:
                body = json.loads(await raw.body())
            except ValueError:
                raise refusal("The request body should be JSON.") from None
            request, checked = self.check(body)
        except APIError as err:
            logger.info("refused (openai api): %s", err.message)
            return error(err)
        answer = Answer(request, checked, self.model_id)
        if not request.stream:
            return await self.whole(answer)
        return await self.streamed(answer)

    def check(self, body: Any) -> tuple[ChatCompletionRequest, ChatRequest]:
        """The request's body validated against OpenAI's fields, what Chat-E does not honour refused, and its chat
        checked within the limits (:func:`~chat_e.data.limits.check_request`); a refusal is an :class:`APIError`
        naming the field."""
        try:
            request = ChatCompletionRequest.model_validate(body)
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise refusal(f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None
        refuse_unhonoured(request)
        system, history, message = split_messages(request.messages)
        mode, context = chat_mode(request, system)
        try:
            checked = check_request(
                self.limits,
                message=message_text(message),
                history=history,
                mode=mode,
                context=context,
                settings=request_settings(request),
                defaults=self.defaults,
                ranges=self.ranges,
                sampling=request_sampling(request),
            )
        except Refused as err:
            name = given_field(request, err.setting)
            if name is None:
                raise refusal(str(err)) from None
            raise refusal(str(err).replace(err.setting, name, 1), param=name) from None
        return request, checked

    async def whole(self, answer: Answer) -> JSONResponse:
        """Every choice's reply, one after the other, in one ``chat.completion``."""
        try:
            for index in answer.choices:
                reply = await run_in_threadpool(
                    self.engine.reply, answer.choice(index), max_waiting=self.limits.max_queue
                )
                answer.add(index, reply)
        except Busy as err:
            return error(APIError(503, str(err), kind="server_error", code="busy"))
        except Exception as err:
            return error(failed(err, answer.checked))
        return JSONResponse(wire(answer.completion()))

    async def streamed(self, answer: Answer):
        """Every choice's reply as it is generated, as ``chat.completion.chunk`` events. A busy server or a failure
        before the first piece is still an HTTP status; after it, the stream's last event."""
        pieces = self.engine.stream(answer.choice(0), max_waiting=self.limits.max_queue)
        try:
            first = await run_in_threadpool(next, pieces, None)
        except Busy as err:
            return error(APIError(503, str(err), kind="server_error", code="busy"))
        except Exception as err:
            return error(failed(err, answer.checked))
        answer.model = answer.model or pieces.model  # the model that makes this reply (named once it started)

        async def events():
            nonlocal pieces
            piece = first
            try:
                for index in answer.choices:  # the choices one after another, each chunk naming its own
                    if index:
                        pieces = self.engine.stream(answer.choice(index), max_waiting=self.limits.max_queue)
                        piece = await run_in_threadpool(next, pieces, None)
                    scanner = StopScanner(answer.request.stops())
                    yield answer.chunk(index, {"role": "assistant", "content": ""})
                    while piece is not None:
                        if shown := scanner.feed(piece):
                            yield answer.chunk(index, {"content": shown})
                        if scanner.stopped:
                            break  # closing the stream (below) stops generating
                        piece = await run_in_threadpool(next, pieces, None)
                    if rest := scanner.flush():
                        yield answer.chunk(index, {"content": rest})
                    await run_in_threadpool(pieces.close)  # its reply: whole, or as far as a stop string let it go
                    answer.done.append(pieces.reply)
                    yield answer.chunk(index, {}, STOP if scanner.stopped else pieces.reply.finish_reason)
                if (answer.request.stream_options or {}).get("include_usage"):
                    yield answer.event(choices=[], usage=usage(answer.done))
                yield "data: [DONE]\n\n"
            except Exception as err:  # after the answer started: the error as the stream's last event
                yield f"data: {json.dumps(failed(err, answer.checked).body())}\n\n"
            finally:  # a client that left (or any end): close the stream, which stops generation
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(pieces.close)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"cache-control": "no-cache"})


class Answer:
    """One request's answer as it is made: its id and time, its choices' requests (each with its own seed) and the
    replies made so far; its ``model`` is ``model_id``, else the model that made the first reply."""

    def __init__(self, request: ChatCompletionRequest, checked: ChatRequest, model_id: str | None):
        self.request, self.checked, self.model = request, checked, model_id
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = range(request.n or 1)
        self.done: list[Reply | None] = []
        self.answers: list[Choice] = []

    def choice(self, index: int) -> ChatRequest:
        """The request of choice ``index``: its own seed (:meth:`RequestSampling.for_choice`)."""
        return self.checked.but(sampling=self.checked.sampling.for_choice(index))

    def add(self, index: int, reply: Reply) -> None:
        """A whole choice's reply, cut at its first stop string."""
        scanner = StopScanner(self.request.stops())
        text = scanner.feed(reply.text) + scanner.flush()
        finish = STOP if scanner.stopped else reply.finish_reason
        message = ChatCompletionMessage(role="assistant", content=text)
        self.answers.append(Choice(index=index, message=message, finish_reason=finish))
        self.done.append(reply)
        self.model = self.model or reply.model

    def completion(self) -> ChatCompletion:
        counts = usage(self.done)
        return ChatCompletion(
            id=self.id,
            object="chat.completion",
            created=self.created,
            model=self.model,
            choices=self.answers,
            **({"usage": counts} if counts else {}),
        )

    def event(self, **fields) -> str:
        chunk = ChatCompletionChunk(
            id=self.id, object="chat.completion.chunk", created=self.created, model=self.model, **fields
        )
        return f"data: {json.dumps(wire(chunk))}\n\n"

    def chunk(self, index: int, delta: dict, finish: str | None = None) -> str:
        return self.event(choices=[ChunkChoice(index=index, delta=ChoiceDelta(**delta), finish_reason=finish)])


def refuse_unhonoured(request: ChatCompletionRequest) -> None:
    """An :class:`APIError` naming the first field Chat-E cannot honour: more choices than it makes, tools, log
    probabilities, a logit bias, a non-text format, too many or too long stop strings."""
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise refusal(f"n should be a whole number from 1 to {MAX_CHOICES}.", param="n")
    if request.tools or request.functions or request.tool_choice not in (None, "none"):
        raise refusal("Chat-E does not call tools: send no tools, functions or tool_choice.", param="tools")
    if request.logprobs:
        raise refusal("Chat-E does not return log probabilities: send logprobs false.", param="logprobs")
    for field, (asks, text) in UNHONOURED.items():
        if asks(getattr(request, field)):
            raise refusal(text, param=field)
    if len(request.stops()) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in request.stops()):
        raise refusal(f"stop takes up to {MAX_STOPS} strings of up to {MAX_STOP_CHARS} characters.", param="stop")


def usage(done: list[Reply | None]) -> CompletionUsage | None:
    """Token counts, where the engine counts them (the local one): the prompt's, and the replies' as generated (their
    end tokens not counted), summed over the choices."""
    if not done or any(d is None or d.tokens is None or d.prompt_tokens is None for d in done):
        return None
    prompt, completion = done[0].prompt_tokens, sum(d.tokens for d in done)
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def error(err: APIError) -> JSONResponse:
    """An :class:`APIError` as OpenAI's error body and status; a busy server's says when to retry."""
    headers = {"retry-after": "5"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def failed(err: BaseException, checked) -> APIError:
    """A generation failure as a 500 in OpenAI's shape; one log line (never a traceback to the client)."""
    text = " ".join(str(err).split())[:300] or type(err).__name__
    logger.error(
        "generation failed (openai api, mode=%s, %d messages): %s: %s",
        checked.mode,
        len(checked.history),
        type(err).__name__,
        text,
    )
    return APIError(500, "Chat-E could not generate a reply; the server's log says why.", kind="server_error")
