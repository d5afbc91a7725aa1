"""SIGTERM drains: 503 for new requests, running streams finish within the grace period,
the rest end cleanly (an error event, [DONE], pages freed), then the server returns."""

from __future__ import annotations

import os
import signal
import time

import msgspec
import trio

from app.guardrails import Guardrails
from app.server import run_server
from app.state import Phase, ServerState
from app.tenants import Tenants
from tests.app.harness import MODEL, assert_error, fake_pool, settings, sse_events


async def test_sigterm_drains_then_stops():
    cfg = settings(drain_grace_s=1.0)
    state = ServerState(cfg, Tenants([]), Guardrails(cfg.guardrails))
    pool = fake_pool(cfg.pools[0], step_delay_s=0.005)
    ended: dict[str, tuple[float, list[str]]] = {}

    async def load():
        return [pool]

    import httpx

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            stopped = trio.Event()

            async def server(task_status):
                await run_server(state, load, handle_signals=True, task_status=task_status)
                stopped.set()

            url = (await nursery.start(server))[0]
            while state.phase is not Phase.READY:
                await trio.sleep(0.001)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:

                async def stream(name: str, max_tokens: int, started: trio.Event) -> None:
                    body = {"model": MODEL, "prompt": name, "max_tokens": max_tokens,
                            "stream": True}
                    lines = []
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for line in r.aiter_lines():
                            started.set()
                            lines.append(line)
                    ended[name] = (time.perf_counter(), sse_events("\n".join(lines)))

                async with trio.open_nursery() as streams:
                    a, b = trio.Event(), trio.Event()
                    streams.start_soon(stream, "short", 40, a)
                    streams.start_soon(stream, "long", 2000, b)
                    await a.wait()
                    await b.wait()
                    t_signal = time.perf_counter()
                    os.kill(os.getpid(), signal.SIGTERM)
                    await trio.sleep(0.05)
                    async with httpx.AsyncClient(base_url=url, timeout=5) as fresh:
                        r = await fresh.get("/health")
                        assert r.status_code == 503 and r.json()["status"] == "draining"
                        r = await fresh.post("/v1/completions", json={
                            "model": MODEL, "prompt": "new", "max_tokens": 2})
                        assert_error(r, 503, type="server_error", code="draining")
            await stopped.wait()  # run_server returned by itself

    short_end, short = ended["short"]
    assert short[-1] == "[DONE]"
    assert msgspec.json.decode(short[-2])["choices"][0]["finish_reason"] == "length"
    long_end, long = ended["long"]

    assert long[-1] == "[DONE]"
    err = msgspec.json.decode(long[-2])["error"]
    assert err["code"] == "stopped" and "shutting down" in err["message"]
    assert 0.9 < long_end - t_signal < 3.0  # the grace period, then ended
    assert sum(s.kv_pages_in_use for s in pool.stats()) == 0
    assert not state.flights


async def test_drain_while_loading_stops_at_once():
    cfg = settings()
    state = ServerState(cfg, Tenants([]), Guardrails(cfg.guardrails))
    loading = trio.Event()

    async def load():
        loading.set()
        await trio.sleep_forever()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            url = (await nursery.start(lambda task_status: run_server(
                state, load, handle_signals=False, task_status=task_status)))[0]
            await loading.wait()
            import httpx

            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.get("/health")
                assert r.status_code == 503 and r.json()["status"] == "loading"
                r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                assert_error(r, 503, code="model_loading")
            state.request_drain()
