"""Prefill and decode apart on the embedded SmolLM2 with the CPU's default formats (int8
weights, int8 KV pool; app/disagg.py): the 19 fidelity prompts, each after a system
prompt starting with its own ticket number (nothing cached, so every prompt crosses),
answered through a decode server whose prompts a prefill server computes, token for
token as one replica answers them once their pages are cached.

The decode side computes a prompt's last partial page as a prefix-cache hit on one
replica does. With an f32 pool that is the cold answer too (tests/app/test_disagg.py, on
a random model); with the int8 pool a near-tie can tip between the cold and the cached
answer of one replica (docs/operations.md, "Prefill and decode apart"), so the single
replica answers each prompt twice: cold, then from its cache."""

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


async def answers(url: str, times: int = 1) -> list[list[list[str]]]:
    """Each prompt's answer (its tokens), asked `times` times in a row."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for i, q in enumerate(FIDELITY):
            got = []
            for _ in range(times):
                r = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 16, "temperature": 0, "logprobs": True,
                    "messages": [{"role": "system", "content": f"Ticket {i}. {SYSTEM}"},
                                 {"role": "user", "content": q}]})
                assert r.status_code == 200, r.text
                got.append([t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]])
            out.append(got)
    return out


async def test_the_fidelity_set_apart_equals_one_replica(embedded_gguf):
    base = msgspec.structs.replace(small_pool(embedded_gguf), dtype="auto",
                                   quantization="auto")  # int8 weights and KV, as served
    async with real_server(settings(base)) as (url, _):
        cold, cached = zip(*await answers(url, times=2))
    async with real_server(settings(msgspec.structs.replace(base, role="prefill"))) as (
            purl, pstate):
        decode = msgspec.structs.replace(base, role="decode", prefill_urls=[purl],
                                         remote_prefill_min_tokens=0)
        async with real_server(settings(decode)) as (url, state):
            apart = [a[0] for a in await answers(url)]
            text = (await httpx.AsyncClient(base_url=url).get("/metrics")).text
            await settle(state)
            await settle(pstate)
            assert pages_in_use(state) == 0 and pages_in_use(pstate) == 0
    assert metric(text, "sluice:remote_prefill_requests_total", outcome="ok") == len(FIDELITY)
    assert metric(text, "sluice:prefix_cache_hits_by_tier_total", tier="remote") > 0
    assert apart == list(cached)
    # Near-ties only: the cold answers differ in a few prompts at most (1 of 19 here).
    assert sum(a != c for a, c in zip(apart, cold)) <= 3
