"""Two models served at once, each its own pool (runner, KV pool, scheduler), routed by
`model`: the shipped config/two-models.toml is valid, and a real server on two tiny
random models of different families (Llama and Gemma 3, sliding window included) streams
both at once to the official openai client, each answer from its own pool, every page
back in its pool at the end; /v1/stats shows Gemma's sliding pages within their bound."""

from __future__ import annotations

import httpx
import openai
import trio

from config.settings import DEFAULT_PRESET, PoolConfig, SchedulerConfig, ServerConfig, Settings
from config.settings import load_settings
from tests.app.browser import browser_page, in_browser
from tests.app.test_real_model import real_server


def test_the_shipped_two_model_config_routes_each_name_to_its_pool():
    s = load_settings(DEFAULT_PRESET.with_name("two-models.toml"))
    assert [(p.name, p.model, p.served_model_names) for p in s.pools] == [
        ("smollm2", "embedded", ["smollm2-135m-instruct"]),
        ("gemma3", "embedded:gemma3-270m", ["gemma-3-270m"])]


def _pool(name: str, model: str) -> PoolConfig:
    return PoolConfig(name=name, model=model, served_model_names=[name], max_context=512,
                      page_size=16, kv_cache_bytes=8 << 20, decode_buckets=[4],
                      prefill_buckets=[64], mixed_decode_buckets=[4], max_prefill_seqs=2,
                      dtype="float32", quantization="none",
                      scheduler=SchedulerConfig(max_running=4, ttft_target_s=0.0))


async def test_two_models_stream_at_once_each_from_its_own_pool():
    settings = Settings(server=ServerConfig(port=0), pools=[
        _pool("llama", "random:tiny"), _pool("gemma", "random:tiny-gemma3")])
    async with real_server(settings) as (url, state):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        listed = [m.id for m in (await client.models.list()).data]
        assert listed == ["llama", "gemma"]
        seen: dict[str, list] = {"llama": [], "gemma": []}

        async def ask(model: str, i: int) -> None:
            stream = await client.completions.create(
                model=model, prompt=f"question {i}: " + "word " * (10 + 7 * i), max_tokens=24,
                temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = [c async for c in stream]
            seen[model].append(("".join(c.choices[0].text for c in chunks if c.choices),
                                {c.model for c in chunks}))

        async with trio.open_nursery() as n:
            for i in range(3):
                for model in seen:
                    n.start_soon(ask, model, i)
        for model, answers in seen.items():
            assert len(answers) == 3 and all(names == {model} for _, names in answers)
        # Each pool ran its own requests: its own engine counted them.
        pools = {p.name: p for p in state.router.pools}
        assert pools["gemma"].config.model == "random:tiny-gemma3"
        assert pools["gemma"].engines[0].runner.pool.window == 16
        for p in pools.values():
            assert sum(s.kv_pages_in_use for s in p.stats()) == 0
        await client.close()
        # Gemma's sliding layers keep pages of their own, bounded by the window: /v1/stats
        # shows them (scheduler/window_pages.py); Llama has none.
        async with httpx.AsyncClient(base_url=url) as http:
            body = (await http.get("/v1/stats", params={"audit": 1})).json()
        stats = {p["name"]: p for p in body["pools"]}
        win = stats["gemma"]["kv_window"]
        assert stats["llama"]["kv_window"] is None
        assert win["window"] == 16 and win["total"] > 0 and win["in_use"] == 0
        assert 0 < win["most_pages_held_ever"] <= win["max_pages_per_seq"]
        assert stats["gemma"]["kv_pages"]["audit_problems"] == []
        async with httpx.AsyncClient(base_url=url) as http:
            metrics = (await http.get("/metrics")).text
        assert 'sluice:kv_window_pages_in_use{model="gemma",pool="gemma"} 0.0' in metrics
        assert 'kv_window_pages_total{model="llama"' not in metrics
        # ... and the dashboard, under Gemma's pool only.
        errors: list[str] = []
        lines = await in_browser(_window_lines, url, errors)
        assert len(lines) == 1 and "sliding layers (16-key window)" in lines[0], lines
        assert errors == [], errors


def _window_lines(url: str, errors: list[str]) -> list[str]:
    with browser_page(errors) as page:
        page.goto(f"{url}/dashboard")
        page.wait_for_selector(".kv-window:not([hidden])", timeout=15000)
        return [e.text_content() for e in page.query_selector_all(".kv-window:not([hidden])")]
