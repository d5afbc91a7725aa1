"""A bound on what one client IP may have in flight at once (`server.max_connections_per_ip`).

ASGI sees requests, not TCP connections: `PerIPLimit` counts the HTTP requests each
client IP has in flight (a stream counts until its last byte is sent), which is what holds
a server's resources (an engine sequence and its KV pages, a stream slot, a task); an idle
keep-alive connection costs next to nothing and is hypercorn's business. One request more
than the limit gets 429 in the OpenAI error shape, with `Retry-After`/`retry-after-ms`,
before the app (or anything it would allocate) sees it. Every path counts, /health
included: a client at its limit is refused whatever it asks for.

The client is `scope["client"]`, the peer's address: behind a reverse proxy every request
comes from the proxy's, so a limit there would bound all clients together (it stays off,
0, by default).
"""

from __future__ import annotations

from typing import Callable

from .door import send_error
from .errors import rate_limited

# A refusal has no natural wait (it lasts until one of the client's requests ends); this
# hint spreads the retries out.
RETRY_AFTER_S = 1.0


class PerIPLimit:
    """ASGI wrapper: at most `limit` HTTP requests in flight per client IP."""

    def __init__(self, app: Callable, limit: int, max_body_bytes: int) -> None:
        self.app = app
        self.limit = limit
        self.max_body_bytes = max_body_bytes  # what a refusal reads of the body, at most
        self.in_flight: dict[str, int] = {}  # client IP -> requests in flight (no zeros)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client")
        ip = client[0] if client else ""  # a Unix socket has no peer address
        count = self.in_flight.get(ip, 0)
        if count >= self.limit:
            return await self._refuse(count, receive, send)
        self.in_flight[ip] = count + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[ip] - 1
            if left:
                self.in_flight[ip] = left
            else:
                del self.in_flight[ip]

    async def _refuse(self, count: int, receive: Callable, send: Callable) -> None:
        err = rate_limited(f"This client already has {count} requests in flight (limit "
                           f"{self.limit} per IP address).", RETRY_AFTER_S,
                           code="too_many_requests_per_ip")
        # Hypercorn (h11) wedges a keep-alive connection answered before its request body
        # arrived (server.py, `drain_request_body`): read the body first; one bigger than
        # any request may be is not read to its end, and its connection is closed instead.
        read = await _read_body(receive, self.max_body_bytes)
        if read is None:  # the client went away: nobody to answer
            return
        await send_error(send, err, close=not read)


async def _read_body(receive: Callable, limit: int) -> bool | None:
    """Read and drop the request body: True once read, False when it is over `limit`
    bytes (the rest is left unread), None when the client went away."""
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            return None
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
        if seen > limit:
            return False
