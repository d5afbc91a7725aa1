"""Issue 17 point 2: faults stay with the requests they touch. A real server on the real
runner with a tiny random model (same code as the embedded one); faults are injected by
test-only wrappers (tests/app/faults.py) around a live engine's runner and detokenizer.

Each test checks the same three things after its fault: the affected requests end with
an error (an SSE error event, or a 5xx for a non-streaming request), every KV page is back
in the pool, and the server goes on serving (/health, a normal request).

(A little over 350 lines: one test per fault family, with the small sidecar the
guardrail faults need.)
"""

from __future__ import annotations

import json
import socket
import time
from contextlib import asynccontextmanager
from functools import partial

import httpx
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from config.settings import GuardrailConfig, PoolConfig, SchedulerConfig, ServerConfig, Settings
from tests.app.faults import BreakingDetokenizer, FaultyRunner
from tests.app.test_real_model import real_server

MODEL = "tiny"


def tiny_settings(*, replicas: int = 1, **server) -> Settings:
    pool = PoolConfig(model="random:tiny", served_model_names=[MODEL], max_context=512,
                      page_size=16, kv_cache_bytes=16 << 20, decode_buckets=[4],
                      prefill_buckets=[64], mixed_decode_buckets=[4], max_prefill_seqs=2,
                      dtype="float32", replicas=replicas,
                      quantization="none",  # f32 products: batches give a lone run's tokens
                      scheduler=SchedulerConfig(max_running=4, ttft_target_s=0.0,
                                                queue_deadline_s=120.0))
    return Settings(server=ServerConfig(port=0, **server), pools=[pool])


def pages_in_use(state) -> int:
    return sum(s.kv_pages_in_use for p in state.router.pools for s in p.stats())


async def settle(state, timeout: float = 10.0) -> None:
    """Until nothing is in flight and every engine is empty (aborts applied)."""
    with trio.fail_after(timeout):
        while state.flights or any(s.running or s.waiting
                                   for p in state.router.pools for s in p.stats()):
            await trio.sleep(0.01)
        await trio.sleep(0.05)


async def stream(http: httpx.AsyncClient, prompt: str, *, max_tokens: int = 300,
                 first: trio.Event | None = None, **kw) -> list:
    """A streamed completion's events (decoded JSON), checked to end with [DONE];
    `first` is set once a token arrived."""
    events: list = []
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, **kw}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
            if first is not None and "choices" in events[-1]:
                first.set()
    assert events and events[-1] == "[DONE]", events[-3:]
    return events[:-1]


def finish_reason(events: list) -> str | None:
    return events[-1]["choices"][0]["finish_reason"] if "choices" in events[-1] else None


def error_of(events: list) -> dict:
    assert "error" in events[-1], events[-2:]
    return events[-1]["error"]


async def normal_request(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "all is well",
                                                 "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5


async def healthy(http: httpx.AsyncClient, status: str = "ok") -> dict:
    r = await http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == status, r.text
    return r.json()


async def test_one_failed_step_nan_logits_and_broken_output_fail_only_their_requests():
    async with real_server(tiny_settings()) as (url, state):
        engine = state.router.pools[0].engines[0]
        faulty = engine.runner = FaultyRunner(engine.runner)
        tokenizer = state.router.pools[0].tokenizer
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            # 1. One step raises: the requests in it fail, streaming and not; then all is well.
            firsts = [trio.Event() for _ in range(3)]
            got: dict[int, object] = {}

            async def streamed(i: int) -> None:
                got[i] = await stream(http, f"prompt number {i}", first=firsts[i])

            async def plain() -> None:
                got[3] = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "a plain one", "max_tokens": 400,
                    "ignore_eos": True})

            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(streamed, i)
                nursery.start_soon(plain)
                for ev in firsts:
                    await ev.wait()
                while engine.stats().running < 4:
                    await trio.sleep(0.001)
                faulty.fail_next = 1
            for i in range(3):
                err = error_of(got[i])
                assert err["type"] == "server_error" and "injected" in err["message"], err
            assert got[3].status_code == 500 and got[3].json()["error"]["type"] == "server_error"
            assert faulty.failed_steps == 1
            await settle(state)
            assert pages_in_use(state) == 0
            await healthy(http)
            await normal_request(http)

            # 2. NaN logits for one sequence: it alone ends with an error; the others in
            # the same steps give exactly the tokens they give without it.
            prompts = ["the first question", "the poisoned question", "the third question"]
            reference = [await stream(http, p, max_tokens=40) for p in prompts]
            first = trio.Event()

            async def poisoned() -> None:
                got["bad"] = await stream(http, prompts[1], max_tokens=300, first=first)

            async def poison_it() -> None:
                await first.wait()
                target = tokenizer.encode(prompts[1])
                seq_id = next(s.seq_id for s in engine._seqs.values()
                              if list(s.prompt_ids[-len(target):]) == target)
                faulty.poison.add(seq_id)

            async def clean(i: int) -> None:
                await first.wait()
                got[i] = await stream(http, prompts[i], max_tokens=40)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(poisoned)
                nursery.start_soon(poison_it)
                for i in (0, 2):
                    nursery.start_soon(clean, i)
            err = error_of(got["bad"])
            assert err["type"] == "server_error" and "not finite" in err["message"], err
            for i in (0, 2):
                assert finish_reason(got[i]) == "length"
                assert _text(got[i]) == _text(reference[i])
            await settle(state)
            assert pages_in_use(state) == 0

            # 3. The detokenizer raises for one sequence, the stop-string check for
            # another: only those two fail.
            engine.detokenizer = BreakingDetokenizer(engine.detokenizer, {
                tuple(tokenizer.encode("BOOM")): "boom",
                tuple(tokenizer.encode("BADTEXT")): "bad_text"})
            async with trio.open_nursery() as nursery:
                for key, prompt, extra in (("boom", "say BOOM now", {}),
                                           ("bad", "say BADTEXT now", {"stop": ["zz"]}),
                                           ("fine", "say nothing odd", {"stop": ["zz"]})):
                    async def one(key=key, prompt=prompt, extra=extra) -> None:
                        got[key] = await stream(http, prompt, max_tokens=30, **extra)
                    nursery.start_soon(one)
            assert "output processing failed" in error_of(got["boom"])["message"]
            assert "output processing failed" in error_of(got["bad"])["message"]
            assert finish_reason(got["fine"]) in ("length", "stop")
            engine.detokenizer = engine.detokenizer.inner
            await settle(state)
            assert pages_in_use(state) == 0
            await healthy(http)
            await normal_request(http)


def _text(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if "choices" in e)


async def test_a_broken_replica_dies_alone_and_the_last_one_fails_fast():
    async with real_server(tiny_settings(replicas=2)) as (url, state):
        pool = state.router.pools[0]
        broken = [FaultyRunner(e.runner) for e in pool.engines]
        for e, f in zip(pool.engines, broken):
            e.runner = f
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            broken[0].fail_always = True
            statuses = []
            for _ in range(8):  # the idle replica 0 is tried first until it is dead
                r = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": "hello", "max_tokens": 4,
                    "ignore_eos": True})
                statuses.append(r.status_code)
            assert statuses[:3] == [500, 500, 500] and set(statuses[3:]) == {200}, statuses
            assert not pool.engines[0].alive and pool.engines[1].alive
            h = await healthy(http, "degraded")
            assert "dead after 3 failed steps" in h["detail"], h
            async with trio.open_nursery() as nursery:  # the live replica takes them all
                for i in range(6):
                    nursery.start_soon(normal_request, http)

            # The last replica dies with requests running and waiting: each ends with an
            # error, nothing hangs, and from then on requests are refused at once. 4 streams
            # run; 12 plain requests wait. Each failed step ends its own requests (500);
            # the third kills the replica, and those still waiting fail at once with 503.
            engine = pool.engines[1]
            streams: list = []
            plain: list[httpx.Response] = []

            async def streamed(i: int) -> None:
                streams.append(await stream(http, f"request {i}", max_tokens=200))

            async def waiting(i: int) -> None:
                plain.append(await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"waiting {i}", "max_tokens": 50,
                    "ignore_eos": True}))

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(streamed, i)
                    while engine.stats().running < 4:
                        await trio.sleep(0.001)
                    for i in range(12):
                        nursery.start_soon(waiting, i)
                    while engine.stats().waiting < 12:
                        await trio.sleep(0.001)
                    broken[1].fail_always = True
            assert all("error" in events[-1] for events in streams), streams
            assert not engine.alive
            assert broken[1].failed_steps == engine.max_consecutive_failures
            codes = sorted(r.status_code for r in plain)
            assert set(codes) == {500, 503}, codes  # failed in a step / when it died
            for r in plain:
                code = r.json()["error"]["code"]
                assert code == ("engine_dead" if r.status_code == 503 else "server_error"), r.text
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "engine_dead"
            assert "dead after 3 failed steps" in r.json()["detail"]
            t0 = time.perf_counter()
            r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                         "max_tokens": 4})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert time.perf_counter() - t0 < 1.0
        assert pages_in_use(state) == 0


async def test_a_client_that_never_reads_is_cut_and_the_engine_goes_on():
    async with real_server(tiny_settings(client_stall_s=1.0)) as (url, state):
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"model": MODEL, "prompt": "talk for a long time",
                           "max_tokens": 480, "stream": True, "ignore_eos": True}).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                with trio.fail_after(30):
                    while not state.flights:
                        await trio.sleep(0.01)
                    # Meanwhile others are served as usual: the engine never waits on it.
                    t0 = time.perf_counter()
                    events = await stream(http, "a reader", max_tokens=100)
                    assert finish_reason(events) == "length"
                    assert time.perf_counter() - t0 < 20
                    await settle(state)  # the stalled one was cut: its flight is closed
                assert pages_in_use(state) == 0
                await healthy(http)
            # The connection was cut before the end (the kernel reset it): no [DONE] came.
            sock.settimeout(10)
            received, reset = b"", False
            try:
                while chunk := sock.recv(65536):
                    received += chunk
            except ConnectionResetError:
                reset = True
            assert reset or (received.startswith(b"HTTP/1.1 200")
                             and b"data: [DONE]" not in received), received[-200:]
        finally:
            sock.close()


class Sidecar:
    """A guardrail sidecar that misbehaves on purpose: /hang never answers, /garbage
    answers 200 with HTML."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/hang":
            await trio.sleep_forever()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": b"<html>not a verdict</html>"})


@asynccontextmanager
async def sidecar():
    cfg = HyperConfig()
    cfg.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, Sidecar(), cfg))
        yield binds[0]
        nursery.cancel_scope.cancel()


def closed_port_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return f"http://127.0.0.1:{port}"


async def test_guardrail_sidecar_faults_cost_one_budget_and_follow_fail_open_or_closed():
    budget_ms = 300.0
    async with sidecar() as side, real_server(tiny_settings()) as (url, state):
        faults = {"hang": f"{side}/hang", "refuse": closed_port_url(),
                  "garbage": f"{side}/garbage"}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            for fault, check_url in faults.items():
                for fail_open in (True, False):
                    # Input direction.
                    state.guard.config = GuardrailConfig(
                        input_url=check_url, input_budget_ms=budget_ms,
                        input_fail_open=fail_open)
                    t0 = time.perf_counter()
                    r = await http.post("/v1/completions", json={
                        "model": MODEL, "prompt": "check me", "max_tokens": 3,
                        "ignore_eos": True})
                    took = time.perf_counter() - t0
                    if fail_open:
                        assert r.status_code == 200, (fault, r.text)
                    else:
                        assert r.status_code == 503, (fault, r.text)
                        assert r.json()["error"]["code"] == "guardrail_unavailable"
                    assert took < budget_ms / 1000 + 1.0, (fault, fail_open, took)

                    # Output direction: each window's check costs at most the budget.
                    state.guard.config = GuardrailConfig(
                        output_url=check_url, output_budget_ms=budget_ms,
                        output_fail_open=fail_open, output_window_chars=64)
                    t0 = time.perf_counter()
                    events = await stream(http, "check my answer", max_tokens=40)
                    took = time.perf_counter() - t0
                    if fail_open:
                        assert finish_reason(events) == "length", (fault, events[-1])
                        assert _text(events), fault
                    else:
                        assert finish_reason(events) == "content_filter", (fault, events[-1])
                    assert took < 3 * budget_ms / 1000 + 2.0, (fault, fail_open, took)

                    # Nothing else slows: the health check answers at once meanwhile.
                    t0 = time.perf_counter()
                    await healthy(http)
                    assert time.perf_counter() - t0 < 0.5
            state.guard.config = GuardrailConfig()
            await settle(state)
            assert pages_in_use(state) == 0
            await normal_request(http)
