"""The door's fast path: a completion request the engines would refuse now gets its 429
in the ASGI layer, before Quart builds a request, a context and a response for it.

Why: a refusal is only worth giving fast. 64 requests arriving at once on open
connections took 120-260 ms (p50) to be refused by an idle server, each ~2-3 ms of
Quart's request and response machinery and our handlers on the one event loop, against
50-60 ms on a bare ASGI app under hypercorn with the same client (docs/history/benchmarks-log.md,
"Issue 16: a strict door, and refusals answered before Quart"). Here a refusal costs reading the body, checking the key,
decoding the body and asking the pools' precheck: what `completions.admit` does before
it would tokenize anything, and nothing else.

Semantics stay `admit`'s: `refusal_at_the_door` runs the same checks in the same order and answers only a refusal of the precheck (429, or 503 when every engine has
stopped); anything else (a bad key, a bad body, an unknown model, a request that would be
admitted) goes on to the app with its body replayed, where `admit` runs in full and
answers as it always has.
"""

from __future__ import annotations

from typing import Callable

from . import responses
from .completions import parse, precheck_pools
from .errors import APIError
from .state import Phase, ServerState

PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion",
         "/v1/responses": "responses"}


def refusal_at_the_door(state: ServerState, kind: str, body: bytes,
                        authorization: str | None) -> APIError | None:
    """The 429 (or 503: every engine stopped) that `admit` would answer this request at
    its precheck, found without tokenizing or awaiting anything; None when it would get
    further (or fail earlier: 503 phase, 401, 400, 404, which `admit` answers itself).
    `DoorFastPath` answers it before Quart builds a request for it."""
    return judge(state, kind, body, authorization)[0]


def judge(state: ServerState, kind: str, body: bytes, authorization: str | None
          ) -> tuple[APIError | None, list]:
    """`refusal_at_the_door`, and the pools whose precheck passed the request (empty when
    refused, or when `admit` will answer it otherwise)."""
    if state.phase is not Phase.READY or state.router is None:
        return None, []
    try:
        state.tenants.authenticate(authorization)  # (the key first, as `admit` checks it)
        p = responses.parse(body)[0] if kind == "responses" else parse(kind, body)
        candidates = state.router.candidates(p.req.model)
        precheck_pools(candidates, p.max_tokens)
    except APIError as e:
        return (e if e.status in (429, 503) else None), []
    except Exception:  # noqa: BLE001 (whatever `admit` would make of it, it says)
        return None, []
    return None, candidates


class Passes:
    """Requests the front door passed that the ASGI layer has not reached yet, by client
    address (a connection's first request; app/front_door.py). Each counts as ahead in
    its pools' precheck (`Pool.admitting`) from the moment the door passes it, as it will
    once it is being tokenized: a flood on new connections is judged at the front door
    in one go, before hypercorn has read any of it, and without this every request of
    it saw nothing ahead and went on to be tokenized and refused one by one. An entry
    the ASGI layer never claims (the client went away first) is released after `TTL_S`."""

    TTL_S = 5.0

    def __init__(self) -> None:
        self._held: dict[tuple, tuple[float, list]] = {}  # client -> (when, pools)

    def hold(self, client: tuple, pools: list, now: float) -> None:
        self.expire(now)
        self.release(client)  # (a new connection from a reused address)
        for p in pools:
            p.admitting += 1
        self._held[client] = (now, pools)

    def release(self, client: tuple) -> None:
        held = self._held.pop(client, None)
        for p in held[1] if held is not None else ():
            p.admitting -= 1

    def expire(self, now: float) -> None:
        while self._held:
            client, (when, _) = next(iter(self._held.items()))
            if now - when < self.TTL_S:
                break
            self.release(client)

    def __len__(self) -> int:
        return len(self._held)


async def send_error(send: Callable, err: APIError, *, close: bool = False) -> None:
    """Answer `err` (OpenAI's error shape, its headers) over ASGI."""
    body = err.body()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DoorFastPath:
    """ASGI wrapper: refuses at once what the precheck refuses (see the module)."""

    def __init__(self, app: Callable, state: ServerState, max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        client = scope.get("client")
        passes = self.state.door_passes
        if client is not None and passes is not None:  # the front door's pass ends here
            passes.release(tuple(client[:2]))
        if kind is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        messages: list[dict] = []  # what was read, replayed to the app
        size, complete = 0, False
        while size <= self.max_body_bytes:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                complete = True
                break
        if complete:
            body = b"".join(m.get("body", b"") for m in messages)
            authorization = next((v.decode("latin-1") for k, v in scope.get("headers", ())
                                  if k.lower() == b"authorization"), None)
            err = refusal_at_the_door(self.state, kind, body, authorization)
            if err is not None:
                return await send_error(send, err)
        replay = iter(messages)

        async def replayed() -> dict:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)
