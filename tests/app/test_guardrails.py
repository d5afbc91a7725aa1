"""Guardrail sidecars: a tiny check service (another hypercorn app) started by the test."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from functools import partial

import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from config.settings import GuardrailConfig
from tests.app.harness import MODEL, assert_error, serve, settings, sse_events


class Sidecar:
    """POST /allow-unless/<word>, /slow, /error; records every payload it saw."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (msg := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        payload = msgspec.json.decode(body)
        self.seen.append(payload)
        path, status = scope["path"], 200
        if path == "/slow":
            await trio.sleep(2)
            verdict = {"allowed": True}
        elif path == "/error":
            status, verdict = 500, {"oops": True}
        else:
            word = path.rsplit("/", 1)[1]
            verdict = {"allowed": word not in payload["window"], "reason": f"has {word!r}"}
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": msgspec.json.encode(verdict)})


@asynccontextmanager
async def sidecar():
    app = Sidecar()
    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, app, cfg))
        yield binds[0], app
        nursery.cancel_scope.cancel()


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


async def test_input_check_refuses_allows_and_fails_open_or_closed():
    async with sidecar() as (url, side):
        for guard, expect in [
            (GuardrailConfig(input_url=f"{url}/allow-unless/forbidden"), 200),
            (GuardrailConfig(input_url=f"{url}/allow-unless/hi"), 400),
            (GuardrailConfig(input_url=f"{url}/slow", input_budget_ms=100), 200),
            (GuardrailConfig(input_url=f"{url}/slow", input_budget_ms=100,
                             input_fail_open=False), 503),
            (GuardrailConfig(input_url=f"{url}/error", input_fail_open=False), 503),
            (GuardrailConfig(input_url="http://127.0.0.1:9/nothing", input_fail_open=True), 200),
        ]:
            async with serve(settings(guardrails=guard)) as srv, srv.client() as http:
                t0 = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=CHAT)
                took = time.perf_counter() - t0
                assert r.status_code == expect, (guard, r.text)
                if expect == 400:
                    assert_error(r, 400, code="content_filter", param="messages")
                if expect == 503:
                    assert_error(r, 503, type="server_error", code="guardrail_unavailable")
                if "slow" in guard.input_url:
                    assert took < 1.0  # the budget (100 ms), not the sidecar's 2 s
                await srv.wait_idle()
                assert srv.pages_in_use() == 0
        assert side.seen[0]["kind"] == "input" and side.seen[0]["text"] == "hi"


async def test_output_windows_are_checked_before_release():
    async with sidecar() as (url, side):
        guard = GuardrailConfig(output_url=f"{url}/allow-unless/q", output_window_chars=8)
        async with serve(settings(guardrails=guard)) as srv, srv.client() as http:
            # Streaming: "hijklmno" passes, the window holding "q" is refused.
            usage = {"include_usage": True}
            r = await http.post("/v1/chat/completions",
                                json={**CHAT, "stream": True, "stream_options": usage})
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            chunks = [msgspec.json.decode(e) for e in events[:-1]]
            text = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in chunks if c["choices"])
            assert text == "hijklmno"
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] \
                == "content_filter"
            windows = [s["window"] for s in side.seen if s["kind"] == "output"]
            assert windows[0] == "hijklmno" and "q" in windows[1]
            assert all(len(w) % 8 == 0 for w in windows)
            # Not streaming: one check of the whole text.
            r = await http.post("/v1/chat/completions", json=CHAT)
            choice = r.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == ("",
                                                                              "content_filter")
            # An answer without "q" passes whole.
            r = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 6,
                                                              "stream": True})
            text = "".join(msgspec.json.decode(e)["choices"][0]["delta"].get("content") or ""
                           for e in sse_events(r.text)[:-1])
            assert text == "hijklm"
            await srv.wait_idle()
            assert srv.pages_in_use() == 0


async def test_slow_output_check_holds_each_window_at_most_its_budget():
    async with sidecar() as (url, _):
        guard = GuardrailConfig(output_url=f"{url}/slow", output_window_chars=10,
                                output_budget_ms=50, output_fail_open=True)
        async with serve(settings(guardrails=guard)) as srv, srv.client() as http:
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30,
                                                              "stream": True})
            took = time.perf_counter() - t0
            text = "".join(msgspec.json.decode(e)["choices"][0]["delta"].get("content") or ""
                           for e in sse_events(r.text)[:-1])
            assert len(text) == 30  # fail-open: released after each budget
            assert took < 1.0  # 3 windows x 50 ms, never the sidecar's 2 s
        guard = GuardrailConfig(output_url=f"{url}/slow", output_window_chars=10,
                                output_budget_ms=50, output_fail_open=False)
        async with serve(settings(guardrails=guard)) as srv, srv.client() as http:
            r = await http.post("/v1/chat/completions", json={**CHAT, "stream": True})
            chunks = [msgspec.json.decode(e) for e in sse_events(r.text)[:-1]]
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
            assert chunks[-1]["choices"][0]["finish_reason"] == "content_filter"
