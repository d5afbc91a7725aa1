"""Run in a subprocess with 4 forced host devices (tests/model/test_tp.py): a real server
with two pools pinned to disjoint devices, a chat pool on devices 0-1 and a long-context
pool on devices 2-3 (each tensor parallel over its two), both serving at once. Prints one
JSON line: each pool's answers and the devices its weights, KV pool and step outputs live on."""

from __future__ import annotations

import json

import httpx
import jax
import trio

from config.settings import PoolConfig, SchedulerConfig, ServerConfig, Settings
from tests.app.test_real_model import real_server


def pool(name: str, devices: list[int], **kw) -> PoolConfig:
    return PoolConfig(name=name, model="random:tiny", served_model_names=["tiny"],
                      max_context=512, page_size=16, kv_cache_bytes=8 << 20,
                      decode_buckets=[4], prefill_buckets=[64], mixed_decode_buckets=[4],
                      max_prefill_seqs=2, dtype="float32", attention="dense",
                      devices=devices, tensor_parallel=len(devices),
                      scheduler=SchedulerConfig(max_running=4, ttft_target_s=0.0), **kw)


async def main() -> None:
    settings = Settings(server=ServerConfig(port=0), pools=[
        pool("chat", [0, 1], max_prompt_tokens=100),
        pool("long", [2, 3], min_prompt_tokens=101)])
    async with real_server(settings) as (url, state):
        answers: dict[str, list] = {"chat": [], "long": []}

        async def ask(http: httpx.AsyncClient, which: str, prompt: str) -> None:
            r = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            answers[which].append(r.json()["choices"][0]["text"])

        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            async with trio.open_nursery() as nursery:  # both pools at once
                for i in range(4):
                    nursery.start_soon(ask, http, "chat", f"short question {i}")
                    nursery.start_soon(ask, http, "long", f"long prompt {i} " + "x" * 150)
        report = {}
        for p in state.router.pools:
            runner = p.engines[0].runner
            leaves = jax.tree.leaves(runner.params)
            report[p.name] = {
                "answers": len(answers[p.name]),
                "steps": sum(s.steps for s in p.stats()),
                "kv_devices": sorted(d.id for d in runner.kv[0].devices()),
                "param_devices": sorted({d.id for a in leaves for d in a.devices()}),
            }
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    trio.run(main)
