"""Who may call Chat-E and how much they may send: an ASGI middleware in front of the whole server (the Gradio app
and the OpenAI-compatible API beside it), and the warning for a server anyone can reach.

:class:`RequestGuard`, for every HTTP request, before any app sees it:

* with an API key, the request needs ``Authorization: Bearer KEY`` -- or, for the Gradio app's paths when the server
  also has a login (``--auth``, Gradio's own), a logged-in session: Gradio's login decides on a request without the
  header. Gradio's login does not cover the paths under ``key_only`` (the OpenAI-compatible API): they take the key
  alone, and on a server with a login but no key they are closed;
* a body over ``max_body_bytes`` gets HTTP 413: by its ``Content-Length`` before a byte of it is read, or, sent
  without one (chunked), as soon as the bytes received pass the limit (the app never sees it);
* a full queue's HTTP 503 says that Chat-E is busy and to try again;
* a login page goes out without the API schema Gradio puts in it (every endpoint's name and parameters, before
  anyone has logged in).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import secrets
from typing import Any

from ..engines.gate import BUSY

#: environment variables that ``chat-e`` reads when ``--api_key`` / ``--auth`` are not given
API_KEY_ENV = "CHAT_E_API_KEY"
AUTH_ENV = "CHAT_E_AUTH"
#: the operator's login of the Train page (chat-e serve --admin)
ADMIN_ENV = "CHAT_E_ADMIN"
#: the user name of requests let in by the API key on a server with a login
API_KEY_USER = "api-key"
NEEDS_KEY = "Chat-E needs its API key: send the header 'Authorization: Bearer KEY'."
WRONG_KEY = "Wrong API key: send the server's key as 'Authorization: Bearer KEY'."
#: how Gradio's page says it is the login page, and the API schema it carries (its frontend escapes "<" in JSON, so
#: the script ends at the first "</script>")
LOGIN_PAGE = b'"auth_required":true'
API_SCHEMA = re.compile(rb"(window\.gradio_api_info = ).*?(;</script>)", re.DOTALL)
NO_KEY_SET = (
    "This Chat-E has a login but no API key, and its API takes the key only: start it with --api_key KEY (or "
    f"{API_KEY_ENV}) and send 'Authorization: Bearer KEY'."
)


def too_large(limit: int) -> str:
    return (
        f"The request body is over {limit:,} bytes, the most Chat-E takes; it was not read. Send a shorter message, "
        "context or history."
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, auth: bool, api_key: bool) -> str | None:
    """The warning for a server that others can reach with neither a login nor an API key, else None."""
    if auth or api_key or is_loopback(host):
        return None
    where = f"--host {host} serves beyond this machine"
    return (
        f"{where}, and Chat-E has neither --auth nor --api_key: anyone who reaches it can use it. Add --auth "
        f"USER:PASSWORD (or {AUTH_ENV}) for people and --api_key KEY (or {API_KEY_ENV}) for programs."
    )


def parse_auth(value: str, flag: str = "--auth") -> tuple[str, str]:
    """``USER:PASSWORD`` -> ``(user, password)``; the password may contain ``:``. ``flag`` names it in a refusal."""
    user, sep, password = value.partition(":")
    if not sep or not user.strip() or not password:
        raise ValueError(f"{flag} takes USER:PASSWORD, both non-empty (e.g. {flag} alice:s3cret).")
    return user.strip(), password


class RequestGuard:
    """ASGI middleware: the API key, the request-body limit and the busy answer (see the module docstring).

    Args:
        app: the ASGI app behind it (the server's FastAPI app, the Gradio app mounted in it).
        max_body_bytes: the largest request body.
        api_key: the key programs send as ``Authorization: Bearer KEY``; None lets requests in without one.
        login_app: the Gradio app whose login (``auth``, session tokens) a request without the key may pass; None:
            the request's own ``scope["app"]``.
        login_apps: path prefix -> the Gradio app mounted there, whose login covers that prefix instead (the
            operator's Train page at ``/admin/``).
        key_only: path prefixes that Gradio's login does not cover (the OpenAI-compatible API's ``/v1/``).
    """

    def __init__(
        self,
        app,
        max_body_bytes: int,
        api_key: str | None = None,
        login_app=None,
        key_only: tuple[str, ...] = (),
        login_apps: dict[str, Any] | None = None,
    ):
        self.app = app
        self.login_apps = dict(login_apps or {})
        self.max_body_bytes = int(max_body_bytes)
        self.api_key = api_key or None
        self.login_app = login_app
        self.key_only = tuple(key_only)
        self._session = secrets.token_urlsafe(32)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        refusal, scope = self._authorize(scope)
        if refusal is not None:
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008, "reason": refusal})
            return await _send_json(send, 401, refusal, [(b"www-authenticate", b"Bearer")])
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.max_body_bytes:
            return await _send_json(send, 413, too_large(self.max_body_bytes), [(b"connection", b"close")])
        body, complete = await self._read_body(receive)
        if body is None:  # the client left before sending its body
            return None
        if not complete:
            return await _send_json(send, 413, too_large(self.max_body_bytes), [(b"connection", b"close")])
        send = self._busy_send(scope, send) if scope.get("method") == "POST" else _login_page_send(send)
        return await self.app(scope, _replay(body, receive), send)

    # ---- API key ------------------------------------------------------------------------------------------------

    def _authorize(self, scope) -> tuple[str | None, Any]:
        """``(refusal or None, scope)``: a request with the right key runs as a session of Gradio's login, if any."""
        path = scope.get("path", "")
        mounted = [prefix for prefix in self.login_apps if path == prefix.rstrip("/") or path.startswith(prefix)]
        app = self.login_app if self.login_app is not None else scope.get("app")
        app = self.login_apps[max(mounted, key=len)] if mounted else app
        key_only = scope.get("path", "").startswith(self.key_only) if self.key_only else False
        login = getattr(app, "auth", None) is not None and not key_only
        if self.api_key is None:
            return (NO_KEY_SET if key_only and getattr(app, "auth", None) is not None else None), scope
        given = _bearer(scope)
        if given is None:
            return (None if login else NEEDS_KEY), scope
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            return WRONG_KEY, scope
        return None, (self._as_session(scope, app) if login else scope)

    def _as_session(self, scope, app):
        """``scope`` with the cookies of a logged-in Gradio session (user :data:`API_KEY_USER`): Gradio's login
        knows sessions only, so the key's requests carry one."""
        app.tokens[self._session] = API_KEY_USER
        ours = "; ".join(
            f"{name}-{app.cookie_id}={self._session}" for name in ("access-token", "access-token-unsecure")
        )
        theirs = [value.decode("latin-1") for name, value in scope["headers"] if name == b"cookie"]
        headers = [(name, value) for name, value in scope["headers"] if name != b"cookie"]
        headers.append((b"cookie", "; ".join([*theirs, ours]).encode("latin-1")))  # ours last: they win
        return {**scope, "headers": headers}

    # ---- body limit ---------------------------------------------------------------------------------------------

    async def _read_body(self, receive) -> tuple[bytes | None, bool]:
        """The whole body, and False once it passes the limit (reading stops there); None if the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, False
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", False
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), True

    # ---- busy ---------------------------------------------------------------------------------------------------

    def _busy_send(self, scope, send):
        """``send`` with a full queue's 503 (``queue/join``, ``call/<api>``) answered by :data:`BUSY`."""
        path = scope.get("path", "")
        if scope.get("method") != "POST" or not (path.endswith("/queue/join") or "/call/" in path):
            return send
        replaced = False

        async def guarded(message):
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] == 503:
                replaced = True
                return await _send_json(send, 503, BUSY, [(b"retry-after", b"5")])
            if not replaced:
                await send(message)

        return guarded


def _login_page_send(send):
    """``send`` for a GET: an HTML page that is Gradio's login page goes out with ``window.gradio_api_info = null``
    (the page needs no schema to log in; once logged in, the app's page carries it); anything else as it is."""
    start, chunks = None, []

    async def guarded(message):
        nonlocal start
        if message["type"] == "http.response.start":
            if dict(message.get("headers", [])).get(b"content-type", b"").startswith(b"text/html"):
                start = message  # held until the body is whole
                return None
            return await send(message)
        if start is None or message["type"] != "http.response.body":
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return None
        body = b"".join(chunks)
        if LOGIN_PAGE in body:
            body = API_SCHEMA.sub(rb"\1null\2", body, count=1)
        headers = [(k, v) for k, v in start["headers"] if k != b"content-length"]
        await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        return await send({"type": "http.response.body", "body": body})

    return guarded


def _bearer(scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _content_length(scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body read already, then the client's own messages (disconnects)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


async def _send_json(send, status: int, detail: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})
