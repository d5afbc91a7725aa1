"""The web console in a real headless Chromium against the real server on the embedded model.

- the chat page streams an answer containing "Paris" token by token, with its TTFT,
  tokens, tokens/s and cached prompt tokens; Stop mid-answer ends the request on the
  server and every KV page goes back to the pool;
- the dashboard, while a load generator runs, shows non-zero running and waiting
  sequences and TTFT figures, its strip chart of steps moves, and it says why the steps
  were built so (the ITL budget's rules, as shares of the steps);
- neither page logs a console error or an uncaught exception.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from config.settings import PoolConfig, SchedulerConfig, ServerConfig, Settings

from .browser import browser_page, in_browser
from .test_real_model import real_server

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"


def _settings(gguf, **sched) -> Settings:
    # The shapes of test_real_model.py: the persistent compile cache serves both.
    pool = PoolConfig(model=str(gguf), max_context=2048, page_size=16,
                      kv_cache_bytes=200 * 16 * 46080, decode_buckets=[4],
                      prefill_buckets=[64, 256], mixed_decode_buckets=[4], dtype="float32",
                      scheduler=SchedulerConfig(max_running=4, max_step_tokens=260, **sched))
    return Settings(server=ServerConfig(port=0), pools=[pool])


def _engine_empty(state) -> bool:
    stats = state.router.pools[0].stats()
    return not state.flights and all(
        s.running == 0 and s.waiting == 0 and s.kv_pages_in_use == 0 for s in stats)


async def _wait_empty(state, timeout: float = 10.0) -> int:
    """Until no request holds a page; returns the tokens generated so far."""
    with trio.fail_after(timeout):
        while not _engine_empty(state):
            await trio.sleep(0.02)
    return sum(s.generation_tokens for s in state.router.pools[0].stats())


def _drive_chat(url: str, state, errors: list[str]) -> dict:
    with browser_page(errors) as page:
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        assert page.input_value("#model") == MODEL
        page.fill("#temperature", "0")
        page.fill("#max-tokens", "40")
        # count the page's updates of the answer while it streams
        page.evaluate("""() => { window.__updates = 0;
            new MutationObserver(() => window.__updates++).observe(
              document.getElementById('conversation'),
              {subtree: true, childList: true, characterData: true}); }""")
        page.fill("#prompt", "What is the capital of France?")
        page.press("#prompt", "Enter")
        page.wait_for_selector("body[data-state=streaming]")
        page.wait_for_selector("body[data-state=idle]", timeout=120_000)
        answer = page.locator(".message.assistant").last
        first = {"text": answer.locator(".content").inner_text(),
                 "meta": answer.locator(".meta").inner_text(),
                 "updates": page.evaluate("window.__updates"),
                 **{k: answer.get_attribute(f"data-{k}") for k in
                    ("finish", "ttft-ms", "tokens", "tokens-per-s", "cached-tokens")}}

        # a long answer, stopped once it has started
        page.fill("#max-tokens", "1500")
        page.fill("#prompt", "Write a very long story about a dragon, in many chapters.")
        page.click("#send")
        page.wait_for_function("""() => {
            const m = [...document.querySelectorAll('.message.assistant')].pop();
            return m && m.querySelector('.content').textContent.length > 40; }""",
                               timeout=120_000)
        assert page.get_attribute("body", "data-state") == "streaming"
        page.click("#stop")
        page.wait_for_selector("body[data-state=idle]")
        stopped = page.locator(".message.assistant").last
        generated = trio.from_thread.run(_wait_empty, state)
        return {"first": first, "stop_finish": stopped.get_attribute("data-finish"),
                "generated": generated, "stop_enabled": page.is_enabled("#stop"),
                "messages": page.locator(".message").count()}


async def test_chat_page_streams_paris_and_stop_frees_every_page(embedded_gguf):
    async with real_server(_settings(embedded_gguf)) as (url, state):
        errors: list[str] = []
        out = await in_browser(_drive_chat, url, state, errors)
        first = out["first"]
        assert "Paris" in first["text"], first
        assert first["finish"] == "stop"
        assert first["updates"] >= 3, first  # the text arrived in pieces, not at the end
        assert int(first["ttft-ms"]) > 0 and int(first["tokens"]) >= 2
        assert float(first["tokens-per-s"]) > 0 and first["cached-tokens"] is not None
        assert "TTFT" in first["meta"] and "tok/s" in first["meta"]
        # Stop: the request ended on the server well before max_tokens, every page back
        assert out["stop_finish"] == "stopped" and not out["stop_enabled"]
        assert out["generated"] < int(first["tokens"]) + 400, out
        assert _engine_empty(state)
        pool = state.router.pools[0].engines[0]
        assert pool.stats().kv_pages_in_use == 0
        assert out["messages"] == 4  # two questions, two answers, in the page
        assert errors == []


async def _load(url: str, stop: trio.Event) -> int:
    """Eight clients asking again and again until `stop`; returns the answers read."""
    done = 0

    async def client() -> None:
        nonlocal done
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            while not stop.is_set():
                async with c.stream("POST", "/v1/chat/completions", json={
                        "model": MODEL, "max_tokens": 48, "stream": True,
                        "messages": [{"role": "user", "content": "Tell me about rivers."}]}) as r:
                    async for _ in r.aiter_bytes():
                        pass
                    done += r.status_code == 200

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(client)
    return done


def _drive_dashboard(url: str, errors: list[str]) -> dict:
    with browser_page(errors) as page:
        page.goto(url + "/dashboard")
        pool = page.locator("section.pool[data-pool=default]")
        pool.wait_for()

        def positive(stat: str) -> None:
            page.wait_for_function(
                f"""() => Number(document.querySelector(
                    'section.pool [data-stat={stat}]')?.dataset.value) > 0""", timeout=120_000)

        for stat in ("running", "waiting", "ttft_p95", "itl_p95", "tokens_per_s"):
            positive(stat)
        chart = pool.locator('[data-chart="steps"]')
        before = int(chart.get_attribute("data-last-step"))
        page.wait_for_function(
            f"""() => Number(document.querySelector('[data-chart="steps"]')
                .dataset.lastStep) > {before} + 3""", timeout=30_000)
        page.wait_for_function("""() => document.querySelector('section.pool .step-plans')
            .dataset.plans !== ''""", timeout=30_000)
        return {"tiles": {t: pool.locator(f'[data-stat="{t}"] dd').inner_text()
                          for t in ("running", "waiting", "ttft_p95", "itl_p95")},
                "plans": pool.locator(".step-plans").get_attribute("data-plans"),
                "plans_text": pool.locator(".step-plans").inner_text(),
                "canvases": pool.locator("canvas").count(),
                "status": page.inner_text("#dash-status")}


async def test_dashboard_shows_the_load_as_it_runs(embedded_gguf):
    # No TTFT target: the queue must hold waiting requests for the dashboard to show.
    async with real_server(_settings(embedded_gguf, ttft_target_s=0.0)) as (url, state):
        errors: list[str] = []
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_load, url, stop)
            out = await in_browser(_drive_dashboard, url, errors)
            stop.set()
        assert out["canvases"] >= 6, out  # every chart drawn
        assert "ready" in out["status"], out
        assert all(v != "–" for v in out["tiles"].values()), out
        # why the steps were built so: the rules' shares of the window's steps, in words
        from scheduler.policy import STEP_PLANS
        plans = dict(kv.split("=") for kv in out["plans"].split(","))
        assert set(plans) <= set(STEP_PLANS) and abs(sum(map(float, plans.values())) - 1) < 0.01
        assert "%" in out["plans_text"], out
        await _wait_empty(state, timeout=60)
        assert errors == []
