"""LoRA adapters on the embedded SmolLM2 through the whole server: one adapter declared in
the config, one loaded at run time by the admin endpoint while 16 streams run, then the
first unloaded while its streams still run. No stream fails, nothing compiles once the
server is ready, and every page and slot is free at the end. The official openai client
streams from an adapter by its name; /v1/models shows the parent."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest
import trio

from app.state import ServerState
from config.settings import (AdapterConfig, PoolConfig, SchedulerConfig, ServerConfig,
                             Settings)
from tests.model.peft import write_peft

from .test_real_model import real_server

pytestmark = pytest.mark.slow
BASE = "smollm2-135m-instruct"
ADMIN = "admin-secret"


def question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Name a colour. ({i})"}]


async def test_adapters_load_and_unload_under_16_streams(embedded_gguf, embedded_model,
                                                         tmp_path, compilations):
    for name, seed in (("support", 1), ("legal", 2)):
        write_peft(tmp_path / name, embedded_model.config, rank=16, seed=seed, std=0.05)
    pool = PoolConfig(model=str(embedded_gguf), max_context=1024, page_size=16,
                      kv_cache_bytes=200 * 16 * 46080, decode_buckets=[16],
                      prefill_buckets=[128], mixed_decode_buckets=[16], dtype="float32",
                      # f32 products: a batch of 16 and a lone request must give the same
                      # tokens, and bf16 activations can tip a near-tie either way.
                      quantization="none",
                      warmup="full", max_loras=2, max_lora_rank=16,
                      adapters=[AdapterConfig("support", str(tmp_path / "support"))],
                      scheduler=SchedulerConfig(max_running=16, max_step_tokens=144,
                                                ttft_target_s=0, itl_target_s=0))
    settings = Settings(server=ServerConfig(port=0, admin_api_key_sha256=hashlib.sha256(
        ADMIN.encode()).hexdigest()), pools=[pool])
    async with real_server(settings) as (url, state):
        compilations.clear()  # warm-up is over ("full"): from here on, nothing compiles
        await _exercise(url, state)
    assert compilations == []


async def _exercise(url: str, state: ServerState) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    pool = state.router.pools[0]
    runner = pool.engines[0].runner

    async def answer(model: str, i: int = 0, n: int = 12) -> tuple[str, str]:
        stream = await client.chat.completions.create(
            model=model, messages=question(i), temperature=0, max_tokens=n, stream=True)
        text, finish = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return text, finish

    base, _ = await answer(BASE)
    support, _ = await answer("support")
    assert support != base  # the adapter is applied
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        models = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        assert models["support"]["parent"] == BASE and models[BASE]["parent"] is None

        results: dict[int, tuple[str, str]] = {}

        async def stream(i: int, model: str) -> None:
            results[i] = (model, *await answer(model, i, n=24))

        async with trio.open_nursery() as n:
            for i in range(12):
                n.start_soon(stream, i, [BASE, "support"][i % 2])
            with trio.fail_after(120):
                while pool.stats()[0].running < 6:
                    await trio.sleep(0.05)
            r = await http.post("/v1/load_lora_adapter", headers=admin, json={
                "lora_name": "legal", "lora_path": runner.lora.paths["support"].replace(
                    "support", "legal")})
            assert r.status_code == 200, r.text
            for i in range(12, 16):
                n.start_soon(stream, i, "legal")
            await trio.sleep(0.5)
            r = await http.post("/v1/unload_lora_adapter", headers=admin,
                                json={"lora_name": "support"})
            assert r.status_code == 200, r.text
            r = await http.post("/v1/chat/completions", json={
                "model": "support", "messages": question(0)})
            assert r.status_code == 404, r.text
        assert len(results) == 16
        for i, (model, text, finish) in results.items():
            assert finish in ("stop", "length") and text, (i, model, finish, text)
        legal, _ = await answer("legal", 12, n=24)
        assert results[12][1] == legal  # in a batch of 16 or alone: the same tokens

        with trio.fail_after(10):
            while pool.stats()[0].running or pool.stats()[0].waiting:
                await trio.sleep(0.05)
        stats = pool.stats()[0]
        assert stats.kv_pages_in_use == 0
        assert stats.adapters["running"] == {} and stats.adapters["waiting"] == {}
        assert stats.adapters["resident"] == ["legal"]  # support's slot was let go
        assert "support" not in runner.lora.paths
        metrics = (await http.get("/metrics")).text
        assert 'sluice:lora_requests_total{adapter="legal"' in metrics
    await client.close()
