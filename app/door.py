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
    if state.phase is not Phase.READY or state.router is None:
        return None
    try:
        state.tenants.authenticate(authorization)  # (the key first, as `admit` checks it)
        p = responses.parse(body)[0] if kind == "responses" else parse(kind, body)
        candidates = state.router.candidates(p.req.model)
        precheck_pools(candidates, p.max_tokens)
    except APIError as e:
        return e if e.status in (429, 503) else None
    except Exception:  # noqa: BLE001 (whatever `admit` would make of it, it says)
        return None
    return None


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
