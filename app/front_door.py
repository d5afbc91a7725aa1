"""The front door: the first request on every new connection is read here, with h11, before
hypercorn builds a protocol, a task group, timers and an ASGI scope for it. A completion
request the precheck refuses gets its 429 from here, and `GET /health` its answer
(`ServerState.health`, what the app's route gives); everything else (the request read so
far replayed) is hypercorn's, as if it had read it itself. A request already in whole when
its connection is accepted (in a flood, all but the first few) is judged by the accept
loop itself: a refusal costs no task, stream or cancel scope. A request the door passes
counts as ahead in its pools' precheck until the ASGI layer has it (`door.Passes`): the
rest of a flood judged in the same turn sees it.

Why: a refusal is only worth giving fast, and in a flood of new connections what a refusal
costs on the one event loop is what the HTTP stack spends per connection. Measured on this
2-core machine (docs/benchmarks.md, "A door that says no in milliseconds"): 300 connections
at once against a bare ASGI app that answers 429 drain in ~200 ms under hypercorn and in
~60-110 ms with h11 alone; the same flood against Sluice, 16 streams decoding, was refused
in 0.48-0.60 s (p99) through hypercorn and is in 0.12-0.20 s through this door. Kept-alive
connections' later requests go through hypercorn, where `door.DoorFastPath` refuses in
the ASGI layer with the same rule (`door.refusal_at_the_door`).

`serve_http` is hypercorn's trio worker (`hypercorn.trio.run.worker_serve`: lifespan,
sockets, graceful shutdown) with this module's accept loop in place of
`trio.serve_listeners`; it uses hypercorn's
TCPServer, Lifespan and WorkerContext, which is why pyproject.toml bounds hypercorn's
version. Plain TCP only: Sluice binds no TLS (a TLS front ends in front of it).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import h11
import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

from .door import PATHS, Passes, judge
from .state import ServerState

log = logging.getLogger("sluice.server")

FIRST_REQUEST_S = 1.0  # a first request not read whole by then is hypercorn's to read
READ_BYTES = 65536
ACCEPT_BATCH = 64  # connections accepted a turn, before the loop lets other tasks run
# accept(2)'s errors that say the system is out of descriptors or memory, for now
ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


class Replayed(trio.abc.HalfCloseableStream):
    """A connection whose first bytes were already read: they come first, then the socket.
    What hypercorn's TCPServer uses of a `trio.SocketStream` (it has no `do_handshake`, so
    hypercorn takes it for plain TCP)."""

    def __init__(self, stream: trio.SocketStream, data: bytes) -> None:
        self.stream = stream
        self.socket = stream.socket
        self._data = data

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._data:
            data, self._data = self._data, b""
            await trio.lowlevel.checkpoint()
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()


HEALTH = "health"  # `GET /health`: answered here too (below)


def _door_kind(request: h11.Request) -> str | None:
    """The completion kind of a request the door may answer, HEALTH, or None (anything
    else, or a client waiting for `100 Continue`, which hypercorn answers)."""
    if any(k == b"expect" for k, _ in request.headers):
        return None
    path = request.target.split(b"?", 1)[0].decode("latin-1")
    if request.method == b"GET":
        return HEALTH if path == "/health" else None
    return PATHS.get(path) if request.method == b"POST" else None


def _response(conn: h11.Connection, status: int, body: bytes,
              more: dict[str, str] | None = None) -> bytes:
    headers = [("content-type", "application/json"), ("content-length", str(len(body)))]
    headers += [(k.lower(), v) for k, v in (more or {}).items()]
    return (conn.send(h11.Response(status_code=status, headers=headers))
            + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))


class _First:
    """A new connection's first request, as far as h11 has read it."""

    def __init__(self, max_body_bytes: int) -> None:
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self.read = bytearray()  # everything received: replayed when hypercorn answers
        self.max_body_bytes = max_body_bytes
        self.kind: str | None = None
        self.authorization: str | None = None
        self.body: list[bytes] = []
        self.size = 0

    def feed(self, data: bytes) -> bool | None:
        """Take `data` (not empty): True once a whole request the door may answer is in,
        False when it is not one (another path, too big, not HTTP/1.1 as h11 reads it:
        hypercorn's), None while more is needed."""
        self.read += data
        self.conn.receive_data(data)
        try:
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    return None
                if isinstance(event, h11.Request):
                    self.kind = _door_kind(event)
                    if self.kind is None:
                        return False
                    self.authorization = next((v.decode("latin-1") for k, v in event.headers
                                               if k == b"authorization"), None)
                elif isinstance(event, h11.Data):
                    self.size += len(event.data)
                    if self.size > self.max_body_bytes:
                        return False
                    self.body.append(event.data)
                else:
                    return isinstance(event, h11.EndOfMessage)
        except h11.RemoteProtocolError:
            return False

    def answer(self, state: ServerState, client: tuple) -> bytes | None:
        """The door's answer to the whole request read, as bytes to send: a refusal, or
        /health's; None: the app's (a request the precheck passed is held as ahead in its
        pools until the app has it: `door.Passes`)."""
        try:
            if self.kind == HEALTH:
                # As the app's route would answer, without a task or ASGI scope while a
                # flood is refused; with a per-IP limit every request counts: the app's.
                if state.settings.server.max_connections_per_ip:
                    return None
                health, status = state.health()
                return _response(self.conn, status, msgspec.json.encode(health))
            err, passed = judge(state, self.kind or "", b"".join(self.body),
                                self.authorization)
            if passed:
                state.door_passes.hold(client[:2], passed, trio.current_time())
            return None if err is None else _response(self.conn, err.status, err.body(),
                                                      err.headers)
        except h11.LocalProtocolError:  # (h11 will not answer this request: hypercorn may)
            return None

    def kept_alive(self) -> bytes | None:
        """After the answer: what the client sent past the request (hypercorn's, the
        connection kept alive), or None when the connection is to close."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
            return self.conn.trailing_data[0]
        return None


async def front_door(state: ServerState, max_body_bytes: int,
                     hand_over: Callable[[trio.abc.Stream], Awaitable[None]],
                     stream: trio.SocketStream, first: _First | None = None) -> None:
    """Read a new connection's first request (`first`: what the accept loop read of it);
    answer it here if the door refuses it, then (or else) hand the connection, with what
    was read and not answered, to hypercorn."""
    first = first or _First(max_body_bytes)
    whole = None
    with trio.move_on_after(FIRST_REQUEST_S):
        try:
            while whole is None:
                data = await stream.receive_some(READ_BYTES)
                if not data:  # gone before a whole request
                    return await stream.aclose()
                whole = first.feed(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return await stream.aclose()
    answer = first.answer(state, _peer(stream.socket)) if whole else None
    if answer is None:
        return await _replay(stream, hand_over, first.read)
    await _answered(stream, answer, first, hand_over)


async def _answered(stream: trio.SocketStream, answer: bytes, first: _First,
                    hand_over) -> None:
    """Send the door's answer (or what the accept loop could not send of it); then the
    connection, kept alive, is hypercorn's, or closed."""
    try:
        await stream.send_all(answer)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return await stream.aclose()
    rest = first.kept_alive()
    if rest is None:
        return await stream.aclose()
    await _replay(stream, hand_over, rest)  # the next requests are hypercorn's


def _peer(sock) -> tuple:
    try:
        return tuple(sock.getpeername())
    except OSError:
        return ("", 0)


async def _handle(handler: Callable[..., Awaitable[None]], sock: socket.socket,
                  *args) -> None:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    try:
        await handler(stream, *args)
    finally:
        await trio.aclose_forcefully(stream)


async def accept_loop(listening: socket.socket, state: ServerState, max_body_bytes: int,
                      hand_over: Callable[[trio.abc.Stream], Awaitable[None]],
                      nursery: trio.Nursery) -> None:
    """Accept what the kernel queued, up to `ACCEPT_BATCH` connections a turn. A request
    already in whole when its connection is accepted (a flood's are, but for the first few)
    is judged at once: a refusal is sent and the socket closed without a task, a stream
    or a cancel scope for it; every other connection gets a `front_door` task. Accept
    errors that mean the system is out of descriptors or memory wait 100 ms, as
    `trio.serve_listeners` does."""
    door = partial(front_door, state, max_body_bytes, hand_over)
    listening.setblocking(False)
    try:
        while True:
            await trio.lowlevel.wait_readable(listening)
            for _ in range(ACCEPT_BATCH):
                try:
                    sock, client = listening.accept()
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    log.error("accept: %s; retrying in 0.1 s", os.strerror(e.errno))
                    await trio.sleep(0.1)
                    break
                sock.setblocking(False)
                try:
                    data = sock.recv(READ_BYTES)
                except BlockingIOError:
                    nursery.start_soon(_handle, door, sock)
                    continue
                except OSError:
                    sock.close()
                    continue
                if not data:
                    sock.close()
                    continue
                first = _First(max_body_bytes)
                whole = first.feed(data)
                if whole is None:
                    nursery.start_soon(_handle, door, sock, first)
                    continue
                answer = first.answer(state, client) if whole else None
                if answer is None:
                    nursery.start_soon(_handle, _replay, sock, hand_over, first.read)
                    continue
                try:
                    sent = sock.send(answer)
                except BlockingIOError:
                    sent = 0
                except OSError:  # reset by the client meanwhile
                    sock.close()
                    continue
                rest = first.kept_alive() if sent == len(answer) else None
                if rest is not None:
                    nursery.start_soon(_handle, _replay, sock, hand_over, rest)
                elif sent == len(answer):
                    sock.close()
                else:  # (a full send buffer on a new connection: not seen, but possible)
                    nursery.start_soon(_handle, _answered, sock, answer[sent:], first,
                                       hand_over)
            await trio.lowlevel.checkpoint()
    finally:
        listening.close()


async def _replay(stream: trio.SocketStream, hand_over, data) -> None:
    await hand_over(Replayed(stream, bytes(data)))


async def serve_http(app, config: Config, state: ServerState, *,
                     shutdown_trigger: Callable[..., Awaitable[None]],
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                     ) -> None:
    """hypercorn's `hypercorn.trio.serve` for an ASGI app on plain TCP, every new
    connection through `front_door` first. Returns once the shutdown trigger fired and the
    connections closed (or `config.graceful_timeout` passed)."""
    app = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    max_body = state.settings.server.max_body_bytes
    state.door_passes = Passes()
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            listeners, binds = [], []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(sock)
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
                log.info("Running on %s", binds[-1])

            async def hypercorn(stream: trio.abc.Stream) -> None:
                await TCPServer(app, config, context, ConnectionState(lifespan_state.copy()),
                                stream)  # type: ignore[arg-type]

            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    for sock in listeners:
                        nursery.start_soon(accept_loop, sock, state, max_body, hypercorn,
                                           server_nursery)
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, others = error.split((ShutdownError, KeyboardInterrupt))
                if others is not None:
                    raise others
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = (trio.current_time()
                                                        + config.graceful_timeout)
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
