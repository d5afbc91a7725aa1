"""Batched against alone, as figures: N greedy requests that share a ~2,000-token system
prompt run through the engine one at a time, then all at once, on the embedded model with
the default runner's weights and KV pool (or the ones named). Prints one JSON line: a hash
of each run's tokens, how many requests' answers differ and where they part, the prefix
cache's share of the batched run's prompt tokens, and the KV pages left in use (0: none
leaked). The hashes are the figures to compare before and after a change meant to change
nothing.

    .venv/bin/python benchmarks/batch_invariance.py [--quantization auto] \
        [--kv-cache-dtype auto] [--requests 32] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import trio

from config.settings import SchedulerConfig
from model.runner import ModelRunner, enable_compilation_cache
from model.weights import load_model
from scheduler.api import FinishEvent, GenerateRequest, TokenEvent
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams

WORDS = ("Sluice is a careful assistant for a platform team. It answers briefly, cites the "
         "runbook, and never invents numbers. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    enable_compilation_cache()
    m = load_model("embedded")
    runner = ModelRunner(m.config, m.params, kv_cache_bytes=600 << 20, max_context=8192,
                         decode_buckets=(1, 8, 32), prefill_buckets=(64, 512),
                         quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    runner.warmup()
    tok, n = m.tokenizer, args.requests
    system = ""
    while len(tok.encode(system)) < 2000:
        system += WORDS
    prompts = [tok.encode_chat([{"role": "system", "content": system},
                                {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}])
               for i in range(n)]
    # Every request admitted at once, whatever the door would predict (batching, not the door).
    cfg = SchedulerConfig(max_step_tokens=512, max_running=max(32, n), kv_reserve_pages=4,
                          ttft_target_s=0.0, queue_deadline_s=600.0)

    async def run(together: bool):
        engine = Engine(runner, tok, cfg)
        out: dict[int, tuple[list[int], int, int]] = {}
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)

            async def one(i: int) -> None:
                h = engine.submit(GenerateRequest(prompt_ids=prompts[i],
                                                  max_tokens=args.max_tokens,
                                                  sampling=SamplingParams(temperature=0.0)))
                ids: list[int] = []
                async for ev in h.events:
                    if isinstance(ev, TokenEvent):
                        ids.extend(ev.token_ids)
                    elif isinstance(ev, FinishEvent):
                        out[i] = (ids, ev.cached_tokens, ev.prompt_tokens)

            if together:
                async with trio.open_nursery() as inner:
                    for i in range(n):
                        inner.start_soon(one, i)
            else:
                for i in range(n):
                    await one(i)
            stats = engine.stats()
            nursery.cancel_scope.cancel()
        return out, stats

    alone, _ = trio.run(run, False)
    batched, stats = trio.run(run, True)

    def sha(res) -> str:
        return hashlib.sha256(json.dumps([res[i][0] for i in range(n)]).encode()).hexdigest()[:16]

    def parts(a: list[int], b: list[int]) -> int:
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    differ = [i for i in range(n) if alone[i][0] != batched[i][0]]
    print(json.dumps({
        "quantization": runner.quantization, "kv_cache_dtype": str(runner.kv_dtype),
        "requests": n, "max_tokens": args.max_tokens,
        "alone_tokens_sha": sha(alone), "batched_tokens_sha": sha(batched),
        "differ": len(differ), "parted_at": [parts(alone[i][0], batched[i][0]) for i in differ],
        "cached_share_batched": round(sum(v[1] for v in batched.values())
                                      / sum(v[2] for v in batched.values()), 4),
        "kv_pages_in_use_after": stats.kv_pages_in_use}))


if __name__ == "__main__":
    main()
