"""The door's fast path (app/door.py): what the precheck refuses is answered in the ASGI
layer, the same 429 the full path gives; anything else reaches the app with its body
intact and is answered as before."""

from __future__ import annotations

import httpx
import pytest

import app.routes
from tests.app.harness import MODEL, TenantConfig, serve, settings, sha

KEY = "sk-door"


def _body(i: int = 0) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"q{i} " + "x" * 1500}],
            "max_tokens": 4}


async def _chunked(payload: bytes):
    for i in range(0, len(payload), 700):  # several ASGI body messages
        yield payload[i:i + 700]


async def test_a_refusal_is_answered_before_the_app(monkeypatch: pytest.MonkeyPatch):
    async def never(*args, **kwargs):
        raise AssertionError("the refusal reached the app")

    # max_waiting 0: the precheck refuses every interactive request.
    async with serve(settings(max_waiting=0)) as srv:
        monkeypatch.setattr(app.routes, "admit", never)
        monkeypatch.setattr(app.routes.responses, "admit", never)
        async with srv.client() as http:
            for path, body in (("/v1/chat/completions", _body()),
                               ("/v1/completions", {"model": MODEL, "prompt": "p",
                                                    "max_tokens": 4, "stream": True}),
                               ("/v1/responses", {"model": MODEL, "input": "p",
                                                  "max_output_tokens": 4})):
                payload = httpx.Request("POST", "/", json=body).content
                r = await http.post(path, content=_chunked(payload),
                                    headers={"content-type": "application/json"})
                assert r.status_code == 429, r.text
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
                assert int(r.headers["retry-after-ms"]) >= 1 and int(r.headers["retry-after"]) >= 1
            # The connection is still good for the next request (the body was read).
            assert (await http.get("/health")).status_code == 200
        assert srv.pool.stats()[0].rejections.get("queue_full", 0) >= 2


async def test_what_the_door_admits_or_cannot_judge_reaches_the_app_whole():
    tenants = [TenantConfig(name="t", api_key_sha256=sha(KEY))]
    async with serve(settings(tenants=tenants)) as srv:
        async with srv.client() as http:
            auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
            payload = httpx.Request("POST", "/", json=_body(1)).content
            r = await http.post("/v1/chat/completions", content=_chunked(payload), headers=auth)
            assert r.status_code == 200, r.text  # the replayed body, every chunk of it
            assert r.json()["usage"]["prompt_tokens"] > 100
            r = await http.post("/v1/chat/completions", json=_body())  # no key: the app's 401
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
            r = await http.post("/v1/chat/completions", headers=auth,
                                json={"model": "nope", "messages": []})
            assert r.status_code in (400, 404)
            r = await http.post("/v1/completions", headers=auth, content=b"{not json")
            assert r.status_code == 400
        await srv.wait_idle()
        assert srv.pages_in_use() == 0


# The front door (app/front_door.py): a new connection's first request, read with h11
# before hypercorn sees the connection.

async def _open(srv):
    import trio

    host, port = srv.url.rsplit("//", 1)[1].rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


def _post(body: bytes, *, close: bool = False, path: str = "/v1/chat/completions") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), b"Connection: close\r\n" if close
                                               else b"", len(body)) + body)


class _Reader:
    """Responses off one connection, by their framing (Content-Length)."""

    def __init__(self, stream) -> None:
        self.stream, self.buf = stream, b""

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            chunk = await self.stream.receive_some(65536)
            assert chunk, f"closed before a response: {self.buf!r}"
            self.buf += chunk
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", 0))
        while len(self.buf) < n:
            self.buf += await self.stream.receive_some(65536)
        body, self.buf = self.buf[:n], self.buf[n:]
        return int(lines[0].split()[1]), headers, body


async def test_the_front_door_refuses_a_new_connections_first_request(
        monkeypatch: pytest.MonkeyPatch):
    """Refused before hypercorn reads it: the same 429 and headers; the connection, kept
    alive, is hypercorn's for its next requests, pipelined or not, and a request whose body
    comes in pieces is read whole first."""
    import trio

    import app.front_door

    asked: list[str] = []
    real = app.front_door.judge

    def counting(state, kind, body, authorization):
        asked.append(kind)
        return real(state, kind, body, authorization)

    monkeypatch.setattr(app.front_door, "judge", counting)
    payload = httpx.Request("POST", "/", json=_body()).content
    async with serve(settings(max_waiting=0)) as srv:
        stream = await _open(srv)
        async with stream:
            request = _post(payload)
            for i in range(0, len(request), 500):  # head and body in several sends
                await stream.send_all(request[i:i + 500])
                await trio.sleep(0.01)
            reader = _Reader(stream)
            status, headers, body = await reader.response()
            assert status == 429 and asked == ["chat"]
            assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            assert b'"queue_full"' in body and headers["content-type"] == "application/json"
            # Two more requests at once on the same connection: hypercorn's now.
            await stream.send_all(_post(payload) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await reader.response())[0] == 429  # DoorFastPath's, in the ASGI layer
            status, _, body = await reader.response()
            assert status == 200 and b"\"ok\"" in body
            assert asked == ["chat"]  # the front door read only the first
        stream = await _open(srv)  # Connection: close: answered and closed
        async with stream:
            completion = httpx.Request("POST", "/", json={"model": MODEL, "prompt": "p",
                                                          "max_tokens": 4}).content
            await stream.send_all(_post(completion, close=True, path="/v1/completions?x=1"))
            assert (await _Reader(stream).response())[0] == 429
            assert await stream.receive_some(10) == b""
        assert asked == ["chat", "completion"]


async def test_what_the_front_door_does_not_answer_hypercorn_does():
    """Other paths, a request slower than the door waits, bad HTTP and a client gone
    before a whole request: each as hypercorn would have it, and the server keeps
    serving with nothing held."""
    import trio

    import app.front_door

    payload = httpx.Request("POST", "/", json=_body()).content
    async with serve(settings(max_waiting=0)) as srv:
        stream = await _open(srv)
        async with stream:  # the body after the door stopped waiting: hypercorn reads it
            request = _post(payload)
            await stream.send_all(request[:100])
            await trio.sleep(app.front_door.FIRST_REQUEST_S + 0.3)
            await stream.send_all(request[100:])
            assert (await _Reader(stream).response())[0] == 429
        stream = await _open(srv)
        async with stream:
            await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
            data = await stream.receive_some(65536)
            assert data == b"" or data.startswith(b"HTTP/1.1 400")
        stream = await _open(srv)
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        await stream.aclose()  # gone mid-head
        async with srv.client() as http:
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/v1/chat/completions", json=_body())
            assert r.status_code == 429
        await srv.wait_idle()
        assert srv.pages_in_use() == 0 and not srv.state.flights


async def test_a_request_already_in_when_accepted_is_answered_without_a_task(
        monkeypatch: pytest.MonkeyPatch):
    """The accept loop reads what a new connection already sent: a whole refused request
    is answered and the socket closed at once (kept alive: handed over after the 429), a
    request the door does not answer goes to hypercorn with its bytes replayed; no
    `front_door` task is started for either."""
    import socket

    import trio

    import app.front_door

    def no_task(*args, **kwargs):
        raise AssertionError("a front_door task was started")

    monkeypatch.setattr(app.front_door, "front_door", no_task)
    payload = httpx.Request("POST", "/", json=_body()).content
    async with serve(settings(max_waiting=0)) as srv:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        sent = [_post(payload, close=True), _post(payload),
                b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"]
        clients = []
        for request in sent:  # all in before the loop accepts
            c = socket.create_connection(listening.getsockname())
            c.sendall(request)
            clients.append(trio.SocketStream(trio.socket.from_stdlib_socket(c)))
        handed: list[bytes] = []

        async def hand_over(stream) -> None:
            handed.append(await stream.receive_some(65536))
            await stream.send_all(b"HTTP/1.1 204 No Content\r\n\r\n")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.front_door.accept_loop, listening, srv.state, 65536,
                               hand_over, nursery)
            closed, kept, models = clients
            assert (await _Reader(closed).response())[0] == 429
            assert await closed.receive_some(10) == b""  # closed at once
            assert (await _Reader(kept).response())[0] == 429
            await kept.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _Reader(kept).response())[0] == 204  # hypercorn's, next
            assert (await _Reader(models).response())[0] == 204
            nursery.cancel_scope.cancel()
        assert sorted(handed) == sorted([sent[2], b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"])
        for c in clients:
            await c.aclose()


async def test_the_front_door_answers_health_as_the_app_does():
    """`GET /health` as a new connection's first request: the door's answer, the app's
    status and JSON (the next request on the connection is hypercorn's, with its own
    headers); loading and draining too; with a per-IP limit the app answers it (every
    request counts there, app/limits.py)."""
    import json

    import msgspec

    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    async with serve(settings()) as srv:
        async def twice():
            stream = await _open(srv)
            async with stream:
                await stream.send_all(health + health)
                reader = _Reader(stream)
                return await reader.response(), await reader.response()

        door, app_ = await twice()
        assert door[0] == app_[0] == 200
        assert json.loads(door[2]) == json.loads(app_[2]) and json.loads(door[2])["status"] == "ok"
        assert "date" not in door[1] and "date" in app_[1]  # the door's, then hypercorn's
        from app.state import Phase
        srv.state.phase = Phase.DRAINING
        door, app_ = await twice()
        assert door[0] == app_[0] == 503 and json.loads(door[2])["status"] == "draining"
        srv.state.phase = Phase.LOADING
        door, app_ = await twice()
        assert door[0] == app_[0] == 503 and json.loads(door[2])["status"] == "loading"
        srv.state.phase = Phase.READY
        ours = srv.state.settings
        srv.state.settings = msgspec.structs.replace(ours, server=msgspec.structs.replace(
            ours.server, max_connections_per_ip=64))
        door, app_ = await twice()
        assert door[0] == 200 and "date" in door[1]  # hypercorn's: the door passed it on


async def test_clients_that_reset_before_they_are_accepted_cost_nothing():
    """Requests sent and reset (RST) before the accept loop gets to them: each socket is
    closed, the loop goes on, and the next client is answered."""
    import socket
    import struct

    import trio

    import app.front_door

    payload = httpx.Request("POST", "/", json=_body()).content
    async with serve(settings(max_waiting=0)) as srv:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        for _ in range(5):
            c = socket.create_connection(listening.getsockname())
            c.sendall(_post(payload))
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()  # RST
        c = socket.create_connection(listening.getsockname())
        c.sendall(_post(payload, close=True))
        last = trio.SocketStream(trio.socket.from_stdlib_socket(c))

        async def hand_over(stream) -> None:
            raise AssertionError("nothing here is hypercorn's")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.front_door.accept_loop, listening, srv.state, 65536,
                               hand_over, nursery)
            assert (await _Reader(last).response())[0] == 429
            nursery.cancel_scope.cancel()
        await last.aclose()


async def test_the_front_doors_passes_count_as_ahead_until_the_app_has_them():
    """Six whole requests judged in one turn of the accept loop, a queue bound of 2: the
    first two pass and each counts as ahead in the pool's precheck at once, so the other
    four are refused there, not passed on to be tokenized and refused one by one. A pass
    the app never claims is released after `Passes.TTL_S`."""
    import socket

    import trio

    import app.front_door

    payload = httpx.Request("POST", "/", json=_body()).content
    async with serve(settings(max_waiting=2)) as srv:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        listening.listen(16)
        clients = []
        for _ in range(6):
            c = socket.create_connection(listening.getsockname())
            c.sendall(_post(payload, close=True))
            clients.append(trio.SocketStream(trio.socket.from_stdlib_socket(c)))
        handed = []

        async def hand_over(stream) -> None:
            handed.append(await stream.receive_some(65536))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.front_door.accept_loop, listening, srv.state, 65536,
                               hand_over, nursery)
            statuses = []
            for c in clients[2:]:
                statuses.append((await _Reader(c).response())[0])
            while len(handed) < 2:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert statuses == [429] * 4 and len(handed) == 2
        passes = srv.state.door_passes
        assert len(passes) == 2 and srv.pool.admitting == 2  # the app never had them
        passes.expire(trio.current_time() + passes.TTL_S)
        assert len(passes) == 0 and srv.pool.admitting == 0
        for c in clients:
            await c.aclose()
