"""Many streams at once: disconnects free their pages; a flooded small queue answers 429."""

from __future__ import annotations

import random
import statistics
import time

import httpx
import msgspec
import openai
import trio

from tests.app.harness import MODEL, serve, settings


async def test_64_streams_a_quarter_disconnecting():
    rng = random.Random(4)
    n, max_tokens = 64, 40
    quitters = set(rng.sample(range(n), n // 4))
    results: dict[int, list[str]] = {}
    async with serve(settings(max_running=16), step_delay_s=0.003) as srv:
        limits = httpx.Limits(max_connections=n + 4)
        async with srv.client(limits=limits) as http:

            async def one(i: int) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"s{i}"}],
                        "max_tokens": max_tokens, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    quit_after = rng.randrange(0, 12) if i in quitters else None
                    lines: list[str] = []
                    async for line in r.aiter_lines():
                        if quit_after is not None and len(lines) >= quit_after:
                            return  # leaving the block closes the connection mid-stream
                        if line.startswith("data: "):
                            lines.append(line[6:])
                    results[i] = lines

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)

        await srv.wait_idle()
        assert srv.pages_in_use() == 0
        assert not srv.state.flights
        async with srv.client() as http:
            metrics = (await http.get("/metrics")).text
        assert f'sluice:kv_pages_in_use{{model="{MODEL}",pool="test"}} 0.0' in metrics
        stats = srv.pool.stats()[0]
        # The quitters really stopped generating (their sequences were aborted).
        assert stats.generation_tokens < n * max_tokens

    assert set(results) == set(range(n)) - quitters
    for i, events in results.items():
        assert events[-1] == "[DONE]", i
        usage = msgspec.json.decode(events[-2])["usage"]
        assert usage["completion_tokens"] == max_tokens, (i, usage)
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in map(msgspec.json.decode, events[:-2]))
        assert len(text) == max_tokens


async def test_flooded_small_queue_gets_fast_429s_and_admitted_complete():
    n = 40
    cfg = settings(max_waiting=4, max_running=2)
    statuses: list[int] = []
    refusals: list[tuple[float, httpx.Response]] = []
    async with serve(cfg, step_delay_s=0.02) as srv:
        async with srv.client(limits=httpx.Limits(max_connections=n + 4)) as http:

            async def one(i: int) -> None:
                t0 = time.perf_counter()
                r = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": f"p{i}", "max_tokens": 10})
                statuses.append(r.status_code)
                if r.status_code == 429:
                    refusals.append((time.perf_counter() - t0, r))
                else:
                    assert r.status_code == 200, r.text
                    assert r.json()["usage"]["completion_tokens"] == 10

            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)

        # The openai client (max_retries=0) sees the same refusal as RateLimitError.
        client = srv.openai()
        errors: list[openai.RateLimitError] = []

        async def oa(i: int) -> None:
            try:
                await client.completions.create(model=MODEL, prompt=f"o{i}", max_tokens=10)
            except openai.RateLimitError as e:
                errors.append(e)

        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(oa, i)
        await client.close()
        assert errors and errors[0].status_code == 429
        assert errors[0].response.headers["retry-after-ms"]
        await srv.wait_idle(30)
        assert srv.pages_in_use() == 0
        assert srv.pool.admitting == 0  # every request past the precheck was counted out

    assert statuses.count(200) >= 6 and refusals, statuses
    for _, r in refusals:
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        assert int(r.headers["retry-after-ms"]) >= 1
        assert int(r.headers["Retry-After"]) >= 1
    waits = sorted(t for t, _ in refusals)
    print(f"\n{len(refusals)}/{n} refused with 429: median "
          f"{statistics.median(waits) * 1000:.1f} ms, max {waits[-1] * 1000:.1f} ms after sending")


async def test_non_streaming_clients_that_give_up_free_their_pages():
    async with serve(step_delay_s=0.005) as srv:
        async with srv.client(timeout=0.1) as http:

            async def impatient(i: int) -> None:
                try:
                    await http.post("/v1/completions", json={
                        "model": MODEL, "prompt": f"q{i}", "max_tokens": 1000})
                except httpx.ReadTimeout:
                    return
                raise AssertionError("1000 tokens at 5 ms a step cannot finish in 0.1 s")

            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(impatient, i)
        await srv.wait_idle()
        assert srv.pages_in_use() == 0
        assert srv.pool.stats()[0].generation_tokens < 8 * 1000
