"""Run in a subprocess with 4 forced host devices (tests/app/test_disagg.py): one server
with a prefill pool on devices 0-1 and a decode pool on devices 2-3 (each tensor parallel
over its two), the decode pool's prompts computed by the prefill pool and their pages put
onto its own devices (`jax.device_put` onto its pool's sharding) and into its pool; then
the same prompts on one pool doing both. Prints one JSON line: both runs' answers, where
each pool's pool lives, and the decode pool's counters."""

from __future__ import annotations

import json

import httpx
import msgspec
import trio

from config.settings import BatchConfig, ServerConfig, Settings
from tests.app.test_disagg import PROMPTS, complete, pool
from tests.app.test_real_model import real_server


def settings(*pools) -> Settings:
    return Settings(server=ServerConfig(port=0, console=False), pools=list(pools),
                    batches=BatchConfig(enabled=False))


async def answers(url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return [(await complete(http, p))["choices"][0]["text"] for p in PROMPTS]


async def main() -> None:
    report: dict = {}
    tp = {"tensor_parallel": 2, "attention": "dense"}
    async with real_server(settings(
            msgspec.structs.replace(pool("prefill"), name="prefill", devices=[0, 1], **tp),
            msgspec.structs.replace(pool("decode", prefill_urls=["pool:prefill"],
                                         remote_prefill_min_tokens=0), name="decode",
                                    devices=[2, 3], **tp))) as (url, state):
        report["apart"] = await answers(url)
        prefill, decode = state.router.pools
        for p in (prefill, decode):
            report[f"{p.name}_kv_devices"] = sorted(
                d.id for d in p.engines[0].runner.kv[0].devices())
        stats = decode.stats()[0]
        report["decode_prefix_hits"] = stats.prefix_cache_hits_tokens
        report["inbox_received"] = decode.engines[0].runner.kv_store.inbox.received_pages
    async with real_server(settings(msgspec.structs.replace(pool(), devices=[0, 1], **tp))
                           ) as (url, _):
        report["alone"] = await answers(url)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    trio.run(main)
