"""One streaming chat completion, timed chunk by chunk.

The SSE stream is parsed here rather than by the openai client: it is cheaper (the load
generator shares two cores with the server under test) and the timestamp of each event is
the moment its bytes were read, not when a higher layer got round to it.

Timing: every time is `time.perf_counter()` relative to the request's send. TTFT is the
time of the first *content-bearing* chunk (a non-empty ``delta.content``): Sluice and vLLM
send an empty role chunk before the model has produced anything, and counting it would
make TTFT meaningless. Events that arrive in one read share one timestamp.

Coalescing: a server may put several tokens in one chunk (Sluice writes whatever piled up
since the last write). Then one chunk is one delivery and one inter-token gap: ITL here is
the gap between consecutive content-bearing chunks, as the user sees it, and as Sluice's
own ``sluice:inter_token_latency_seconds`` counts it. The number of tokens each chunk
carried is not in the stream, so `apportion` estimates it: one token per chunk, plus the
remainder of the usage's ``completion_tokens`` split in proportion to the chunks'
characters. Without a usage chunk every content chunk counts as one token (what the
OpenAI API itself sends) and `usage_reported` is False. Per-token pace is reported
separately as TPOT (see stats.py), which does not depend on how tokens were grouped.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import trio

from .workloads import RequestSpec

CHAT_PATH = "/v1/chat/completions"


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one request did. `status` is one of:

    ok, rate_limited (HTTP 429), http_error (any other non-200), stream_error (an error
    event or a stream cut short), timeout, transport_error (could not connect, reset),
    cancelled (the run ended it, e.g. the short streams of long-interference), dropped
    (an open loop's arrival not sent because ``--max-inflight`` requests were in flight).
    """

    index: int
    tag: str
    start: float  # send time, seconds since the run began
    max_tokens: int
    status: str = "pending"
    http_status: int | None = None
    ttft: float | None = None  # seconds from send to the first content-bearing chunk
    e2e: float | None = None  # seconds from send to [DONE], or to the refusal or error
    chunk_times: list[float] = []  # content-bearing chunks, seconds since send
    chunk_tokens: list[int] = []  # tokens each carried (estimated, see `apportion`)
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    retry_after: float | None = None  # seconds, from retry-after-ms or Retry-After
    error: str | None = None
    reconnects: int = 0  # sent again: the kept-alive connection was closed, no answer

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive content-bearing chunks."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None  # legacy completions
    finish_reason: str | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def apportion(total: int, weights: list[int]) -> list[int]:
    """Split ``total`` tokens over chunks: one each, the rest in proportion to ``weights``.

    Largest-remainder rounding keeps the sum exact. If ``total`` is below the number of
    chunks (a server whose usage disagrees with its stream) every chunk counts one.
    """
    n = len(weights)
    if n == 0:
        return []
    rest = total - n
    if rest <= 0:
        return [1] * n
    w = sum(weights)
    shares = [rest * x / w for x in weights] if w else [rest / n] * n
    base = [int(s) for s in shares]
    order = sorted(range(n), key=lambda k: base[k] - shares[k])  # biggest remainder first
    for k in order[:rest - sum(base)]:
        base[k] += 1
    return [1 + b for b in base]


def retry_after_of(headers: httpx.Headers) -> float | None:
    """Seconds to wait: ``retry-after-ms`` (what Sluice and OpenAI send) else Retry-After."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is not None:
            try:
                return float(value) * scale
            except ValueError:
                pass  # an HTTP date: not worth parsing for a benchmark
    return None


def open_client(base_url: str, connections: int, *, api_key: str | None = None,
                timeout_s: float = 300.0) -> httpx.AsyncClient:
    """HTTP/1.1 client with a pool of exactly ``connections``: one per concurrent stream.

    HTTP/1.1 because it is what a load balancer speaks to a backend and because httpx's
    HTTP/2 leaves abandoned streams open. `trust_env=False`: no proxy between us and
    the target.
    """
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout,
                             headers=headers, trust_env=False)


async def send(http: httpx.AsyncClient, spec: RequestSpec, rec: RequestRecord, *,
               model: str | None, extra: dict[str, Any], timeout_s: float) -> None:
    """Send ``spec`` and fill ``rec`` in place (so a cancelled request keeps what it saw)."""
    body: dict[str, Any] = {"messages": spec.body(), "max_tokens": spec.max_tokens,
                            "stream": True, "stream_options": {"include_usage": True}, **extra}
    if model:
        body["model"] = model
    content = msgspec.json.encode(body)
    start = time.perf_counter()

    async def attempt() -> bool:  # False: the connection died before any answer
        try:
            async with http.stream("POST", CHAT_PATH, content=content,
                                   headers={"Content-Type": "application/json"}) as r:
                rec.http_status = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    rec.e2e = time.perf_counter() - start
                    rec.retry_after = retry_after_of(r.headers)
                    rec.status = "rate_limited" if r.status_code == 429 else "http_error"
                    rec.error = raw[:300].decode("utf-8", "replace")
                    return True
                await _read_events(r, rec, start)
        except httpx.RemoteProtocolError:
            if rec.http_status is not None or rec.reconnects:
                raise
            rec.reconnects += 1
            return False
        return True

    try:
        with trio.move_on_after(timeout_s) as scope:
            # A server may close a kept-alive connection just as a request goes out on it
            # (llama.cpp's server does; the request was never read): send it once more on
            # a new connection, as the openai client's retries do, and count it.
            if not await attempt():
                await attempt()
        if scope.cancelled_caught:
            rec.status, rec.error = "timeout", f"no answer within {timeout_s} s"
    except httpx.TimeoutException as e:  # httpx's own (between reads; same limit)
        rec.status, rec.error = "timeout", f"{type(e).__name__}: {e}"
    except httpx.HTTPError as e:
        rec.status, rec.error = "transport_error", f"{type(e).__name__}: {e}"
    finally:
        if rec.status == "pending":
            rec.status = "cancelled"
        _finish_counts(rec)


async def _read_events(r: httpx.Response, rec: RequestRecord, start: float) -> None:
    buf = b""
    done = False
    stream = r.aiter_bytes()
    async for data in stream:
        now = time.perf_counter() - start
        buf = (buf + data).replace(b"\r\n", b"\n")
        while not done:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            event, buf = buf[:end], buf[end + 2:]
            payload = b"\n".join(_field(line) for line in event.split(b"\n")
                                 if line.startswith(b"data:"))
            if not payload:
                continue  # a comment or keep-alive
            if payload == b"[DONE]":
                done = True
                break
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError as e:
                rec.status, rec.error = "stream_error", f"bad SSE data: {e}"
                rec.e2e = now
                return
            if chunk.error is not None:
                err = chunk.error
                rec.status = "stream_error"
                rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
                rec.e2e = now
                return
            n = 0
            for c in chunk.choices:
                n += len((c.delta.content or "") if c.delta else (c.text or ""))
                rec.finish_reason = c.finish_reason or rec.finish_reason
            if n:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(n)  # characters for now: see _finish_counts
            if chunk.usage is not None:
                u = chunk.usage
                rec.usage_reported = True
                rec.prompt_tokens, rec.output_tokens = u.prompt_tokens, u.completion_tokens
                if u.prompt_tokens_details is not None:
                    rec.cached_tokens = u.prompt_tokens_details.cached_tokens
        if done:
            break
    rec.e2e = time.perf_counter() - start
    if done:
        # Read the body's end (HTTP/1.1's last chunk) so that the connection goes back to
        # the pool instead of being closed: a new connection per request is not the load
        # a real client makes. A server that never ends the body gets a second.
        with trio.move_on_after(1.0):
            async for _ in stream:
                pass
    if done or rec.finish_reason is not None:
        rec.status = "ok"
    else:
        rec.status, rec.error = "stream_error", "the stream ended before [DONE]"


def _field(line: bytes) -> bytes:
    """A ``data:`` line's value (the SSE spec drops one leading space, no more)."""
    value = line[5:]
    return value[1:] if value.startswith(b" ") else value


def _finish_counts(rec: RequestRecord) -> None:
    """TTFT, and the chunks' characters turned into estimated token counts."""
    if rec.chunk_times:
        rec.ttft = rec.chunk_times[0]
    if rec.output_tokens is None:
        rec.output_tokens = len(rec.chunk_times)
    rec.chunk_tokens = apportion(rec.output_tokens, rec.chunk_tokens)
