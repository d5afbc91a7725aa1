"""Run in a subprocess with 4 forced host devices (tests/model/test_tp.py): the KV tiers'
copies down and up on a pool split by KV head over 1 and 2 devices, six prompts through a
pool that holds about three, then the first three again from the host tier. Prints one
JSON line per degree: the greedy tokens and the host tier's hits."""

from __future__ import annotations

import json

import jax
import trio

from model.runner import ModelRunner
from tests.model.test_runner import TINY, random_params
from tests.test_kv_tiers import PAGE, prompt, serve


def run(tp: int) -> dict:
    runner = ModelRunner(TINY, random_params(TINY), page_size=PAGE, num_pages=40,
                         max_context=512, decode_buckets=(4,), prefill_buckets=(64,),
                         block_q=8, max_prefill_seqs=2, kv_host_bytes=64 * 4096,
                         devices=jax.devices()[:tp] if tp > 1 else None)
    runner.warmup()
    requests = [(t, 0, "") for t in range(6)] + [(t, 0, "") for t in range(3)]
    out, engine = trio.run(serve, runner, requests)
    engine.scheduler.pages.check([])
    assert prompt(0, 0)  # the same prompts as tests/test_kv_tiers.py
    return {"tp": tp, "tokens": [toks for toks, _ in out],
            "host_hits": engine.scheduler.pages.tiers.hit_tokens["host"]}


if __name__ == "__main__":
    for tp in (1, 2):
        print(json.dumps(run(tp)), flush=True)
