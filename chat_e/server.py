"""Serve a Chat-E Blocks app: a FastAPI app with the Gradio UI mounted at ``/`` (``gradio.mount_gradio_app``), API
routers beside it (the OpenAI-compatible ``/v1``), :class:`chat_e.http.guard.RequestGuard` in front of everything, run by
uvicorn. Every ``chat-e`` command serves its Blocks through :func:`serve`, so all of them are guarded and limited
alike.

Gradio's ``launch`` is not used: a mounted app has the routers beside it under one guard. What ``launch`` did is
done here: Gradio's login (``auth``), the upload size limit, the session capacity, the theme, the footer, errors kept
on the server; the queue's startup events run in the app's lifespan.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any

from .data.limits import ChatLimits
from .http.guard import RequestGuard

logger = logging.getLogger(__name__)

AUTH_MESSAGE = "Chat-E: log in with the user and password its server was started with."
#: seconds that running requests get to finish once the server is told to stop (a streamed reply may be long)
GRACEFUL_SHUTDOWN_SECONDS = 5


def create_app(  # long: the one app's parts in the order a request meets them
    demo,
    *,
    auth: tuple[str, str] | None = None,
    api_key: str | None = None,
    limits: ChatLimits | None = None,
    routers: Sequence[Any] = (),
    mounts: Sequence[tuple[str, Any, tuple[str, str] | None]] = (),
    host: str = "127.0.0.1",
    port: int = 7860,
):
    """The server's FastAPI app: ``routers`` first (a router's paths win over Gradio's catch-all mount), then each
    ``(path, blocks, login)`` of ``mounts`` (the operator's Train page at ``/admin``, behind its own login; the
    app's arena at ``/arena``, behind the chat's), then
    ``demo`` mounted at ``/`` with Gradio's login (``auth``), and :class:`~chat_e.http.guard.RequestGuard` in front of
    all. The routers' paths take the API key alone (Gradio's login does not cover them)."""
    from fastapi import FastAPI  # noqa: PLC0415 (optional extra: comes with gradio, which only serving needs)

    from .web.ui import import_gradio, theme  # noqa: PLC0415 (imports gradio)

    gr = import_gradio()
    limits = limits or ChatLimits()
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the API is documented by Gradio and docs/api.md
    prefixes = []
    for router in routers:
        app.include_router(router)
        prefixes += [route.path.rsplit("/", 1)[0] + "/" for route in router.routes]
    # what every page's mount shares: where it is served, the login page's message, no tracebacks, the body limit
    common = dict(server_name=host, server_port=port, auth_message=AUTH_MESSAGE)
    common.update(show_error=False, max_file_size=limits.max_body_bytes)
    for path, blocks, login in mounts:
        blocks.state_session_capacity = limits.max_sessions  # what launch(state_session_capacity=...) sets
        gr.mount_gradio_app(app, blocks, path=path, auth=login, **common)
    demo.state_session_capacity = limits.max_sessions
    gr.mount_gradio_app(app, demo, path="/", footer_links=["api"], auth=auth, theme=theme(), **common)
    app.add_middleware(
        RequestGuard,
        max_body_bytes=limits.max_body_bytes,
        api_key=api_key,
        login_app=mounted_gradio_app(app),
        key_only=tuple(sorted(set(prefixes))),
        login_apps={f"{path}/": mounted_gradio_apps(app)[path] for path, _, _ in mounts},
    )
    return app


def mounted_gradio_apps(app) -> dict[str, Any]:
    """The Gradio apps that ``mount_gradio_app`` mounted in ``app``, by path (``""``: ``/``)."""
    from gradio.routes import App  # noqa: PLC0415 (optional extra: app)

    return {route.path: route.app for route in app.routes if isinstance(getattr(route, "app", None), App)}


def mounted_gradio_app(app):
    """The Gradio app that ``mount_gradio_app`` mounted in ``app`` at ``/`` (its login and session tokens)."""
    found = mounted_gradio_apps(app).get("")
    if found is not None:
        return found
    raise ValueError("no Gradio app is mounted in this app")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one); OSError when the address cannot be had."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = found[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT; a listening one still fails
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(
    demo,
    *,
    host: str,
    port: int,
    auth: tuple[str, str] | None = None,
    api_key: str | None = None,
    limits: ChatLimits | None = None,
    routers: Sequence[Any] = (),
    mounts: Sequence[tuple[str, Any, tuple[str, str] | None]] = (),
) -> None:
    """Serve ``demo`` (and ``routers`` and ``mounts`` beside it, see :func:`create_app`) on ``host:port`` until stopped (Ctrl-C,
    SIGTERM). Port 0 picks a free port.

    Raises:
        OSError: the address cannot be had (a port in use, a host that is not this machine's); nothing is served.
        RuntimeError: the app did not start (its lifespan failed; uvicorn logged why).
    """
    import uvicorn  # noqa: PLC0415 (optional extra: comes with gradio)

    class _EndingHeartbeats(uvicorn.Server):
        """uvicorn's server that, told to stop, also ends the Gradio sessions' heartbeat streams at once, as Gradio's
        own ``launch`` does when it closes (``App.stop_event``). Open for as long as a browser tab or a client is,
        they would otherwise hold the shutdown for its whole grace period and then be cancelled, one traceback
        each; replies still being generated keep the grace period to finish."""

        def __init__(self, config, gradio_apps):
            super().__init__(config)
            self.gradio_apps = gradio_apps

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            for gradio_app in self.gradio_apps:
                gradio_app.stop_event.set()  # the signal arrives on the loop's thread, between its steps

    sock = bind(host, port)
    try:
        bound = sock.getsockname()[1]
        app = create_app(
            demo, auth=auth, api_key=api_key, limits=limits, routers=routers, mounts=mounts, host=host, port=bound
        )
        shown = f"[{host}]" if ":" in host else host
        logger.info("serving on http://%s:%d/", shown, bound)
        config = uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
            lifespan="on",
        )
        server = _EndingHeartbeats(config, list(mounted_gradio_apps(app).values()))
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:  # uvicorn logs why (a startup event that failed) and returns
        raise RuntimeError(f"the server on {host}:{bound} did not start; its log above says why")
