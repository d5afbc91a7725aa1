"""Run in a subprocess with forced host devices (tests/model/test_tp.py): the same greedy
requests through ModelRunner at several tensor-parallel degrees; prints one JSON line
per degree: tokens, logits of the first steps, and the step's collectives."""

from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np

from model.config import ModelConfig
from model.runner import ModelRunner
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int):
    """Prefill every prompt (one chunk each, together), then decode all together:
    returns (tokens per prompt, logits rows per step)."""
    ps = runner.page_size
    tables, nxt = [], 1
    for p in prompts:
        n = -(-(len(p) + steps + 1) // ps)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    greedy = SamplingParams(temperature=0.0)
    out = [[] for _ in prompts]
    logits = []
    plan = StepPlan([SeqChunk(i, p, 0, tables[i], True, greedy) for i, p in enumerate(prompts)])
    for s in range(steps):
        res = runner.step(plan, return_logits=True)
        logits.append([np.asarray(res.logits[i]).tolist() for i in range(len(prompts))]
                      if s < 2 else None)
        for i in range(len(prompts)):
            out[i].append(res.sampled[i].token_id)
        plan = StepPlan([SeqChunk(i, [out[i][-1]], len(prompts[i]) + s, tables[i], True,
                                  greedy, num_generated=s + 1) for i in range(len(prompts))])
    return out, logits


def main() -> None:
    which, degrees = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    if which == "embedded":
        from model.weights import load_model

        loaded = load_model("embedded", progress=False)
        cfg, params = loaded.config, loaded.params
    else:
        cfg = ModelConfig(name="llama-shaped", vocab_size=512, hidden_size=128,
                          intermediate_size=352, num_layers=2, num_heads=8, num_kv_heads=4,
                          head_dim=16, max_position=1024, eos_token_ids=(2,))
        from model.weights import init_random_params

        params = init_random_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(cfg.vocab_size, 4000), n).tolist() for n in (5, 23, 40)]
    for n in degrees:
        runner = ModelRunner(cfg, params, page_size=16, num_pages=64, max_context=256,
                             decode_buckets=(4,), prefill_buckets=(128,),
                             mixed_decode_buckets=(0,), max_prefill_seqs=3, dtype="float32",
                             attention="dense", quantization="none",
                             devices=jax.devices()[:n])
        runner.warmup()
        tokens, logits = greedy_run(runner, prompts, 12)
        hlo = "\n".join(runner._steps[b].as_text() for b in runner.programs.ready)
        pool = "x".join(map(str, runner.kv[0].shape))
        print(json.dumps({
            "tp": n, "tokens": tokens, "logits": logits,
            "all_reduce": len(re.findall(r"all-reduce\(", hlo)) + len(
                re.findall(r"all-reduce-start\(", hlo)),
            "all_gather": len(re.findall(r"all-gather", hlo)),
            "kv_shards": sorted({tuple(s.data.shape) for s in runner.kv[0].addressable_shards}),
            "pool": pool,
        }), flush=True)


if __name__ == "__main__":
    main()
