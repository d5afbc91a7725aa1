"""Speculative decoding through the whole server (tiny random model, a real hypercorn
server, the openai client), by n-gram lookup and by a draft model: streamed answers equal
those of a server without it, vLLM's
`spec_decode` counters on /metrics, the pool's `speculative` in /v1/stats, every page back."""

from __future__ import annotations

import httpx
import openai
import pytest

from config.settings import PoolConfig, SchedulerConfig, ServerConfig, Settings
from tests.app.test_faults import pages_in_use, settle
from tests.app.test_kv_tiers_server import metric
from tests.app.test_real_model import real_server

MODEL = "tiny"
PROMPTS = [("the gate opens, the water falls, the gate closes. " * 6) + f"again {i}:"
           for i in range(6)]


def settings(speculative: str) -> Settings:
    pool = PoolConfig(model="random:tiny", served_model_names=[MODEL], max_context=512,
                      page_size=16, kv_cache_bytes=200 * 8192, decode_buckets=[4, 16],
                      prefill_buckets=[64, 128], mixed_decode_buckets=[4, 16],
                      max_prefill_seqs=2, dtype="float32", quantization="none",
                      scheduler=SchedulerConfig(
                          max_running=4, ttft_target_s=0.0, queue_deadline_s=120.0,
                          ngram_min=1, speculative=speculative,
                          draft_model="random:tiny" if speculative == "draft" else None))
    return Settings(server=ServerConfig(port=0, console=False), pools=[pool])


async def answers(url: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    out = []
    for p in PROMPTS:
        stream = await client.completions.create(model=MODEL, prompt=p, max_tokens=24,
                                                 temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True})
        out.append("".join([c.choices[0].text async for c in stream]))
    return out


@pytest.mark.parametrize("mode", ["ngram", "draft"])
async def test_streamed_answers_equal_plain_decoding_and_the_counters_say_so(mode):
    """n-gram lookup, and a draft model (here the served model itself: its greedy
    guesses are all accepted)."""
    async with real_server(settings("off")) as (url, _):
        plain = await answers(url)
    async with real_server(settings(mode)) as (url, state):
        spec = await answers(url)
        await settle(state)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            text = (await http.get("/metrics")).text
            stats = (await http.get("/v1/stats", params={"audit": "1"})).json()
        assert pages_in_use(state) == 0
    assert spec == plain
    drafts = metric(text, "sluice:spec_decode_num_drafts_total")
    proposed = metric(text, "sluice:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "sluice:spec_decode_num_accepted_tokens_total")
    assert drafts >= 1 and proposed >= drafts and 0 <= accepted <= proposed
    assert metric(text, "sluice:spec_decode_num_accepted_tokens_per_pos_total",
                  position="0") <= drafts
    pool = stats["pools"][0]
    assert pool["kv_pages"]["audit_problems"] == []
    assert pool["speculative"]["mode"] == mode
    if mode == "draft":
        assert accepted == proposed
    assert len(pool["speculative"]["acceptance_by_position"]) == 4
