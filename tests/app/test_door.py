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
