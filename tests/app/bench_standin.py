"""A stand-in OpenAI-compatible server whose timings are known, for the benchmark's tests.

A plain ASGI app on hypercorn (an ephemeral port in the test's nursery, or a process:
``python -m tests.app.bench_standin serve --host H --port P [--ttft S] ...``, which is how
the sweep's ``--spawn`` is tested). A chat completion streams an empty role chunk at
once, then after ``ttft_s`` the first content chunk, then one chunk every ``itl_s``; each
chunk carries ``tokens_per_chunk`` tokens of text "tok " (the last may carry fewer);
``max_tokens`` tokens in all. Then the finish chunk, the usage chunk and ``[DONE]``.

- More than ``capacity`` streams in flight: 429 at once with ``retry-after-ms``.
- A prompt of more than ``long_words`` words is "long": its first token waits
  ``long_ttft_s`` and every other stream stalls meanwhile (a prefill that blocks decode).
- ``POST /tokenize`` counts 2 tokens a word (so calibration finds 0.5 words a token);
  usage counts prompt tokens the same way.
- ``GET /metrics`` has Sluice-named series. The counters start from non-zero values (a
  server that ran before) so the tests see deltas: each request adds its prompt tokens to
  the prefix-cache queries and half of them to the hits.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

MODEL = "standin-model"


@dataclass
class StandIn:
    ttft_s: float = 0.05
    itl_s: float = 0.02
    tokens_per_chunk: int = 1
    capacity: int | None = None
    retry_after_ms: int = 250
    long_words: int = 5000
    long_ttft_s: float = 0.5
    in_flight: int = 0
    stall_until: float = 0.0
    counters: dict[str, float] = field(default_factory=lambda: {
        "prefix_cache_queries": 1000.0, "prefix_cache_hits": 0.0, "num_preemptions": 3.0,
        "engine_busy_seconds": 10.0, "generation_tokens": 500.0, "prompt_tokens": 1000.0})
    rejected: float = 7.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    clients: set[tuple[str, int]] = field(default_factory=set)  # connections seen

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        route = (scope["method"], scope["path"])
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        if route == ("GET", "/health"):
            await _json(send, 200, {"status": "ok"})
        elif route == ("GET", "/v1/models"):
            await _json(send, 200, {"object": "list", "data": [{"id": MODEL}]})
        elif route == ("GET", "/metrics"):
            await _text(send, 200, self.metrics())
        elif route == ("POST", "/tokenize"):
            n = 2 * len(json.loads(body)["prompt"].split())
            await _json(send, 200, {"tokens": list(range(n)), "count": n})
        elif route == ("POST", "/v1/chat/completions"):
            self.clients.add(tuple(scope["client"]))
            await self.chat(json.loads(body), send)
        else:
            await _json(send, 404, {"error": {"message": "no such route"}})

    def metrics(self) -> str:
        lines = []
        for name, value in self.counters.items():
            lines += [f"# TYPE sluice:{name}_total counter",
                      f'sluice:{name}_total{{model="{MODEL}",pool="p"}} {value}']
        lines += ["# TYPE sluice:requests_rejected_total counter",
                  f'sluice:requests_rejected_total{{model="{MODEL}",pool="p",'
                  f'reason="overloaded"}} {self.rejected}',
                  "# TYPE sluice:kv_cache_usage_perc gauge",
                  f'sluice:kv_cache_usage_perc{{model="{MODEL}",pool="p"}} '
                  f"{min(1.0, self.in_flight / 8)}",
                  "# TYPE sluice:engine_busy_fraction gauge",
                  f'sluice:engine_busy_fraction{{model="{MODEL}",pool="p"}} 0.25']
        return "\n".join(lines) + "\n"

    async def chat(self, req: dict[str, Any], send: Any) -> None:
        self.bodies.append(req)
        if self.capacity is not None and self.in_flight >= self.capacity:
            self.rejected += 1
            await _json(send, 429, {"error": {"message": "overloaded", "type":
                                              "rate_limit_error", "code": "overloaded"}},
                        [(b"retry-after-ms", str(self.retry_after_ms).encode()),
                         (b"retry-after", b"1")])
            return
        self.in_flight += 1
        try:
            await self._stream(req, send)
        finally:
            self.in_flight -= 1

    async def _stream(self, req: dict[str, Any], send: Any) -> None:
        words = sum(len(m["content"].split()) for m in req["messages"])
        prompt_tokens, n = 2 * words, req["max_tokens"]
        self.counters["prefix_cache_queries"] += prompt_tokens
        self.counters["prefix_cache_hits"] += prompt_tokens / 2
        self.counters["prompt_tokens"] += prompt_tokens
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})

        async def event(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(),
                        "more_body": True})

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {"id": "c1", "object": "chat.completion.chunk", "created": 0,
                    "model": MODEL, "choices": [{"index": 0, "delta": delta,
                                                 "finish_reason": finish}]}

        await event(chunk({"role": "assistant", "content": ""}))
        if words > self.long_words:
            self.stall_until = trio.current_time() + self.long_ttft_s
            await trio.sleep(self.long_ttft_s)
        else:
            await trio.sleep(self.ttft_s)
        left = n
        for k in range(math.ceil(n / self.tokens_per_chunk)):
            if k:
                await trio.sleep(self.itl_s)
            await trio.sleep_until(self.stall_until)  # a long prefill holds everyone
            m = min(self.tokens_per_chunk, left)
            left -= m
            self.counters["generation_tokens"] += m
            await event(chunk({"content": "tok " * m}))
        await event(chunk({}, "length"))
        if (req.get("stream_options") or {}).get("include_usage"):
            await event({"id": "c1", "object": "chat.completion.chunk", "created": 0,
                         "model": MODEL, "choices": [],
                         "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                   "total_tokens": prompt_tokens + n}})
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _json(send: Any, status: int, obj: Any,
                headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore[assignment]
    await _respond(send, status, json.dumps(obj).encode(),
                   [(b"content-type", b"application/json"), *headers])


async def _text(send: Any, status: int, text: str) -> None:
    await _respond(send, status, text.encode(), [(b"content-type", b"text/plain")])


async def _respond(send: Any, status: int, body: bytes,
                   headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def serve(app: StandIn, host: str = "127.0.0.1", port: int = 0, *,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; ``task_status.started(url)`` once bound."""
    cfg = HyperConfig()
    cfg.bind = [f"{host}:{port}"]
    cfg.accesslog = None
    cfg.graceful_timeout = 0.5
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: hypercorn_serve(
            app, cfg, task_status=task_status))  # type: ignore[arg-type]
        task_status.started(binds[0])


def _main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["serve"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ttft", type=float, default=0.05)
    p.add_argument("--itl", type=float, default=0.02)
    args = p.parse_args()
    try:
        trio.run(serve, StandIn(ttft_s=args.ttft, itl_s=args.itl), args.host, args.port)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    _main()
