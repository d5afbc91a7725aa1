"""The KV tiers through the whole server (tiny random model, a real hypercorn server): the
config keys, /metrics with vLLM-style names, /v1/stats and its audit, and nothing leaked
after prompts that push each other down the tiers and back up."""

from __future__ import annotations

import re

import httpx
import pytest

from config.settings import PoolConfig, SchedulerConfig, ServerConfig, Settings
from tests.app.test_faults import pages_in_use, settle
from tests.app.test_real_model import real_server

MODEL = "tiny"


def settings(tmp_path) -> Settings:
    # 16-token pages of 8 KiB: a 40-page device pool holds about four of the prompts below.
    pool = PoolConfig(model="random:tiny", served_model_names=[MODEL], max_context=512,
                      page_size=16, kv_cache_bytes=40 * 8192, decode_buckets=[4],
                      prefill_buckets=[64], mixed_decode_buckets=[4], max_prefill_seqs=2,
                      dtype="float32", quantization="none",
                      kv_host_bytes=64 * 8192, kv_disk_dir=str(tmp_path / "kv"),
                      kv_disk_bytes=1 << 20,
                      scheduler=SchedulerConfig(max_running=4, ttft_target_s=0.0,
                                                queue_deadline_s=120.0))
    return Settings(server=ServerConfig(port=0, console=False), pools=[pool])


def metric(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def complete_with(http: httpx.AsyncClient, prompt: str) -> str:
    r = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_disk_tier_needs_a_host_tier(tmp_path):
    with pytest.raises(ValueError, match="kv_host_bytes"):
        PoolConfig(kv_disk_dir=str(tmp_path))


async def test_prompts_go_down_the_tiers_and_back_up(tmp_path):
    prompts = [f"Tenant {i} system prompt. " + "abcdefghij" * 14 + f" question {i}?"
               for i in range(6)]
    async with real_server(settings(tmp_path)) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async def complete(p: str) -> str:
                return await complete_with(http, p)

            first = [await complete(p) for p in prompts]
            again = [await complete(p) for p in prompts[:3]]  # evicted: from the host tier
            assert again == first[:3]
            await settle(state)
            text = (await http.get("/metrics")).text
            assert metric(text, "sluice:prefix_cache_hits_by_tier_total", tier="host") > 0
            assert metric(text, "sluice:kv_tier_copy_bytes_total", direction="down") > 0
            assert metric(text, "sluice:kv_tier_copy_bytes_total", direction="up") > 0
            assert metric(text, "sluice:kv_tier_pages", tier="host") > 0
            assert metric(text, "sluice:kv_tier_capacity_bytes", tier="disk") == 1 << 20
            assert re.search(r'sluice:kv_tier_bytes\{[^}]*tier="device"', text)
            stats = (await http.get("/v1/stats", params={"audit": "1"})).json()
            pool = stats["pools"][0]
            assert pool["kv_pages"]["audit_problems"] == []
            tiers = pool["kv_tiers"]
            assert tiers["host_pages"] > 0 and tiers["host_slots"] == 64
            assert tiers["disk_pages"] is not None
            assert metric(text, "sluice:kv_tier_pages", tier="host") == tiers["host_pages"]
            assert pages_in_use(state) == 0
    # Stopped, its cached prefixes went to disk: the next start serves them from there.
    async with real_server(settings(tmp_path)) as (url, state):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            assert await complete_with(http, prompts[5]) == first[5]
            text = (await http.get("/metrics")).text
            assert metric(text, "sluice:prefix_cache_hits_by_tier_total", tier="disk") > 0
            await settle(state)
            assert pages_in_use(state) == 0
