"""The server: a quart-trio app on hypercorn's trio worker, and the one nursery that owns it.

`run_server` opens one nursery holding hypercorn (and through it every connection and
every stream; each new connection's first request is read by the front door first,
app/front_door.py), the engine loops of every pool, and the signal watcher. The port is bound
first, so /health answers 503 "loading" while the model loads and warms up; then the
engines start and the server turns ready. A crash in an engine loop or in loading takes
the whole nursery down visibly instead of leaving a half-alive server.

Drain (first SIGINT/SIGTERM, or `state.request_drain`): new requests get 503, engines stop
admitting, running streams get `drain_grace_s` to finish; what is left is then ended
cleanly (an error event and ``[DONE]``, its sequence aborted), hypercorn closes, and the
engine loops are cancelled. A second signal ends the running streams the same clean way
at once, without waiting out the grace; a third cancels everything.
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Awaitable, Callable

import trio
from hypercorn.config import Config as HyperConfig
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import disagg
from .door import DoorFastPath
from .front_door import serve_http
from .errors import APIError, error_type_for
from .limits import PerIPLimit
from .pools import Pool, Router
from .priority import keep_compute_below
from .routes import FLIGHTS_KEY, register_routes
from .state import Phase, ServerState

log = logging.getLogger("sluice.server")
STOP_MESSAGE = "The server is shutting down; the request was ended before it finished."


def _error_response(e: APIError) -> Response:
    return Response(e.body(), status=e.status, content_type="application/json",
                    headers=e.headers)


def create_app(state: ServerState) -> QuartTrio:
    app = QuartTrio("sluice", static_folder=None)  # the console serves /static (console.py)
    app.config["RESPONSE_TIMEOUT"] = None  # Quart's 60 s default silently cuts long streams
    app.config["MAX_CONTENT_LENGTH"] = state.settings.server.max_body_bytes
    # Batch files have their own limit (bigger than any request body, by default).
    limits = {"/v1/files": state.settings.batches.max_file_bytes}

    class Request(app.request_class):  # type: ignore[name-defined, misc]
        def __init__(self, method, scheme, path, *args, max_content_length=None, **kw):
            super().__init__(method, scheme, path, *args,
                             max_content_length=limits.get(path, max_content_length), **kw)

    app.request_class = Request
    register_routes(app, state, started=int(time.time()))

    @app.errorhandler(APIError)
    async def api_error(e: APIError) -> Response:
        return _error_response(e)

    @app.errorhandler(HTTPException)
    async def http_error(e: HTTPException) -> Response:
        code = e.code or 500
        name = (e.name or "error").lower().replace(" ", "_")
        headers = {k: v for k, v in e.get_headers() if k.lower() == "allow"}  # 405 needs it
        return _error_response(APIError(code, e.description or e.name or "error",
                                        type=error_type_for(code), code=name, headers=headers))

    @app.errorhandler(Exception)
    async def server_error(e: Exception) -> Response:
        log.exception("unhandled error")
        return _error_response(APIError(500, f"Internal error: {type(e).__name__}",
                                        type="server_error", code="internal_error"))

    @app.after_request
    async def drain_request_body(response: Response) -> Response:
        """Read what is left of the request body before answering.

        Hypercorn 0.18 (h11) wedges a keep-alive connection when a response completes
        before the request body has arrived: the *next* request on it gets no answer at
        all. Answers given before the body is read (404/405 routing, 401, automatic
        OPTIONS) would hang clients that reuse connections. A body over the size limit
        cannot be drained (413): that connection is closed instead, and the answer says so
        (`Connection: close`), or a client that reuses it races the close and gets no
        answer to its next request.
        """
        try:
            await request.get_data(cache=False)
        except HTTPException:
            response.headers["Connection"] = "close"
        return response

    app.asgi_app = _CloseFlights(app.asgi_app)  # type: ignore[method-assign]
    app.asgi_app = DoorFastPath(app.asgi_app, state,  # type: ignore[method-assign]
                                state.settings.server.max_body_bytes)
    per_ip = state.settings.server.max_connections_per_ip
    if per_ip:  # outermost: a refused request reaches nothing
        app.asgi_app = PerIPLimit(app.asgi_app, per_ip,  # type: ignore[method-assign]
                                  state.settings.server.max_body_bytes)
    return app


class _CloseFlights:
    """ASGI safety net: closes every flight a request admitted once the request is over.

    The SSE body's own `finally` normally does it; but a client that disconnects before
    the body generator first runs (e.g. while the response head is being sent) never
    starts it, and an unstarted generator runs no `finally`.
    """

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[FLIGHTS_KEY] = flights = []
        try:
            await self.app(scope, receive, send)
        finally:
            for flight in flights:
                flight.close()


class _Hyper(HyperConfig):
    """Hypercorn's config, whose listening TCP sockets cut stalled clients.

    A client that stops reading fills its socket buffers, then the stream's writes block
    (hypercorn shields them from cancellation, so the app cannot time them out). The
    engine never waits for it (tokens pile up, coalesced, in the request's bounded channel
    and output buffer), but its request would hold KV pages, a stream slot and the
    connection for as long as the client stays. With TCP_USER_TIMEOUT (Linux; inherited by
    accepted sockets) the kernel aborts a connection whose sent data has been waiting
    unacknowledged or behind a zero receive window for `stall_s`; the blocked write then
    fails, hypercorn closes the connection, and the stream's cleanup aborts the request
    (pages back to the pool). Elsewhere the option does not exist and nothing is set.
    """

    stall_s: float = 0.0

    def create_sockets(self):
        sockets = super().create_sockets()
        user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
        if self.stall_s > 0 and user_timeout is not None:
            for sock in sockets.secure_sockets + sockets.insecure_sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, user_timeout,
                                    max(1, int(self.stall_s * 1000)))
        return sockets


async def drain(state: ServerState, grace_s: float) -> None:
    state.phase = Phase.DRAINING
    for pool in state.router.pools if state.router else []:
        pool.start_draining()
    async with trio.open_nursery() as nursery:
        with trio.move_on_after(grace_s) as waiting:
            nursery.start_soon(_cancel_on, state.drain_now, waiting)  # a second signal
            while state.flights:
                await state.idle.wait()
        nursery.cancel_scope.cancel()
    left = list(state.flights)
    if left:
        log.warning("drain: ending %d requests still running (%s)", len(left),
                    "asked to stop now" if state.drain_now.is_set()
                    else f"after {grace_s:.1f}s of grace")
    for flight in left:
        flight.stop(STOP_MESSAGE)


async def run_server(
    state: ServerState,
    load_pools: Callable[[], Awaitable[list[Pool]]],
    *,
    on_listening: Callable[[list[str]], None] | None = None,
    on_ready: Callable[[list[str]], None] | None = None,
    handle_signals: bool = True,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until drained. `task_status.started(binds)` once the port is bound. The
    batch store is opened first: a second server on the same store stops here, before
    binding (`StoreLocked`)."""
    cfg = state.settings.server
    from .batches import open_batches

    state.batches = await open_batches(state)
    state.metrics.batches = state.batches
    hconf = _Hyper()
    hconf.stall_s = cfg.client_stall_s
    hconf.backlog = cfg.listen_backlog
    hconf.bind = [f"{cfg.host}:{cfg.port}"]
    hconf.graceful_timeout = 5.0  # streams were already drained; this only flushes writes
    hconf.accesslog = None
    hconf.errorlog = logging.getLogger("hypercorn.error")  # through our logging, once
    stop_http, http_done = trio.Event(), trio.Event()

    async def http(task_status: trio.TaskStatus[list[str]]) -> None:
        try:
            await serve_http(create_app(state), hconf, state, shutdown_trigger=stop_http.wait,
                             task_status=task_status)
        finally:
            http_done.set()

    try:
        async with trio.open_nursery() as nursery:
            if handle_signals:
                nursery.start_soon(_watch_signals, state, nursery.cancel_scope)
            binds = await nursery.start(http)
            nursery.start_soon(state.metrics.live.run, state)  # the console's 1 s samples
            nursery.start_soon(keep_compute_below, cfg.compute_nice)
            if on_listening:
                on_listening(binds)
            task_status.started(binds)
            with trio.CancelScope() as loading:  # a drain during loading just stops
                nursery.start_soon(_cancel_on, state.drain_requested, loading)
                pools = await load_pools()
                disagg.check_roles(pools)
                for pool in pools:
                    if pool.config.role == "decode":
                        pool.remote = disagg.RemotePrefill(
                            pool, state.metrics, {p.name: p for p in pools})
                for pool in pools:
                    await nursery.start(pool.run)
                state.ready(Router(pools))
                if state.batches is not None:  # stored batches go on where they were
                    await nursery.start(state.batches.worker.run)
                if on_ready:
                    on_ready(binds)
                await state.drain_requested.wait()
            await drain(state, cfg.drain_grace_s)
            stop_http.set()  # hypercorn returns once its connections are closed
            with trio.move_on_after(hconf.graceful_timeout + 1):
                await http_done.wait()
            nursery.cancel_scope.cancel()  # the engine loops
    finally:
        for pool in state.router.pools if state.router else []:
            pool.close()
        with trio.CancelScope(shield=True):
            for pool in state.router.pools if state.router else []:
                if pool.remote is not None:
                    await pool.remote.aclose()
            await state.guard.aclose()
            if state.batches is not None:
                await state.batches.aclose()


async def _cancel_on(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _watch_signals(state: ServerState, everything: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not state.drain_requested.is_set():
                log.warning("%s: draining (again to end running streams now)", name)
                state.request_drain()
            elif not state.drain_now.is_set():
                log.warning("%s: ending running streams now (again to stop at once)", name)
                state.request_drain(now=True)
            else:
                everything.cancel()
