"""Prefill and decode apart on the embedded SmolLM2 (app/disagg.py): the 19 fidelity
prompts, each after a system prompt starting with its own ticket number (nothing cached,
so every prompt crosses), answered through a decode server whose prompts a prefill
server computes, token for token as one replica answers them.

- f32 weights and pool: as one replica computing each prompt cold. A key read from the
  pool is the one computed, so where a prompt's pages were computed cannot show.
- int8 weights and pool (the CPU's default): as one replica whose prompt's full pages
  were cached first. The decode side computes the last partial page from the pages it
  received, as a prefix-cache hit does; a cold replica computes those tokens in the same
  chunk as the ones before them, reading those keys before they were rounded to int8,
  which can tip a near-tie (docs/operations.md, "Prefill and decode apart")."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from config.settings import BatchConfig, ServerConfig, Settings
from tests.app.test_faults import pages_in_use, settle
from tests.app.test_kv_tiers_server import metric
from tests.app.test_real_model import real_server, small_pool
from tests.model.test_speculative_real import FIDELITY

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SYSTEM = ("You are the support assistant of a water company. Answer briefly and politely, "
          "in plain words, and say so when you do not know. " * 2)


def settings(pool) -> Settings:
    return Settings(server=ServerConfig(port=0, console=False), pools=[pool],
                    batches=BatchConfig(enabled=False))


def messages(i: int, q: str) -> list[dict]:
    return [{"role": "system", "content": f"Ticket {i}. {SYSTEM}"},
            {"role": "user", "content": q}]


async def answers(url: str, *, cache_pages_first: bool = False) -> list[list[str]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for i, q in enumerate(FIDELITY):
            if cache_pages_first:  # the prompt's full pages alone first: cached
                ids = (await http.post("/tokenize", json={
                    "model": MODEL, "messages": messages(i, q)})).json()["tokens"]
                r = await http.post("/v1/completions", json={
                    "model": MODEL, "prompt": ids[:len(ids) // 16 * 16], "max_tokens": 1})
                assert r.status_code == 200, r.text
            r = await http.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 24, "temperature": 0, "logprobs": True,
                "messages": messages(i, q)})
            assert r.status_code == 200, r.text
            out.append([t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]])
    return out


async def apart(base) -> list[list[str]]:
    async with real_server(settings(msgspec.structs.replace(base, role="prefill"))) as (
            purl, pstate):
        decode = msgspec.structs.replace(base, role="decode", prefill_urls=[purl],
                                         remote_prefill_min_tokens=0)
        async with real_server(settings(decode)) as (url, state):
            got = await answers(url)
            text = (await httpx.AsyncClient(base_url=url).get("/metrics")).text
            await settle(state)
            await settle(pstate)
            assert pages_in_use(state) == 0 and pages_in_use(pstate) == 0
    assert metric(text, "sluice:remote_prefill_requests_total", outcome="ok") == len(FIDELITY)
    assert metric(text, "sluice:prefix_cache_hits_by_tier_total", tier="remote") > 0
    return got


async def test_f32_apart_equals_one_replica_computing_cold(embedded_gguf):
    base = small_pool(embedded_gguf)
    async with real_server(settings(base)) as (url, _):
        alone = await answers(url)
    assert await apart(base) == alone


async def test_int8_apart_equals_one_replica_with_the_pages_cached(embedded_gguf):
    base = msgspec.structs.replace(small_pool(embedded_gguf), dtype="auto",
                                   quantization="auto")  # int8 weights and KV, as served
    async with real_server(settings(base)) as (url, _):
        alone = await answers(url, cache_pages_first=True)
    assert await apart(base) == alone
