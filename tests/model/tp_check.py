"""Run in a subprocess with forced host devices (tests/model/test_tp.py): the same greedy
requests through ModelRunner at several tensor-parallel degrees; prints one JSON line
per degree: tokens, logits of the first steps, and the step's collectives.

`python -m tests.model.tp_check WHICH DEGREES [FORMAT]`: WHICH "random" (a Llama-shaped
model), "gemma" (a Gemma 3-shaped one: sliding layers of 16 keys, q/k and sandwich norms,
GeGLU) or "embedded" (SmolLM2); FORMAT one of `FORMATS`: "f32" (default: f32 weights, dense
attention), "int8" or "q4_1" (the native packed weights beside the CPU attention and its
default pool, "auto"), "int8-bf16" (int8 weights, a bf16 pool), "int8-lora" (the default
preset and native LoRA slots holding two random adapters, some requests under one, some
under none, in one batch), "f32-lora" (the stacked LoRA form on f32 weights)."""

from __future__ import annotations

import json
import re
import sys
import tempfile

import jax
import numpy as np

from model.config import ModelConfig
from model.runner import ModelRunner
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan
from model.bench import window_table

ADAPTERS = ("a", "b")
FORMATS = {  # name: (quantization, kv_cache_dtype, LoRA slots)
    "f32": ("none", "auto", False), "int8": ("int8", "auto", False),
    "q4_1": ("q4_1", "auto", False), "int8-bf16": ("int8", "bfloat16", False),
    "int8-lora": ("int8", "auto", True), "f32-lora": ("none", "auto", True)}


def greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int,
               slots: list[int] | None = None, loads: tuple = (), every: bool = False):
    """Prefill every prompt (one chunk each, together), then decode all together:
    returns (tokens per prompt, logits rows of the first two steps, or of `every` step).
    `slots`: each prompt's adapter slot (-1: none); `loads`: the (slot, adapter) pairs
    the first step loads."""
    ps = runner.page_size
    slots = slots or [-1] * len(prompts)
    tables, nxt = [], 1
    for p in prompts:
        n = -(-(len(p) + steps + 1) // ps)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    greedy = SamplingParams(temperature=0.0)
    out = [[] for _ in prompts]
    logits = []
    plan = StepPlan([SeqChunk(i, p, 0, tables[i], True, greedy, adapter_slot=slots[i],
                              window_table=window_table(runner, i, 0, len(p)))
                     for i, p in enumerate(prompts)], adapter_loads=list(loads))
    for s in range(steps):
        res = runner.step(plan, return_logits=True)
        logits.append([np.asarray(res.logits[i]).tolist() for i in range(len(prompts))]
                      if s < 2 or every else None)
        for i in range(len(prompts)):
            out[i].append(res.sampled[i].token_id)
        plan = StepPlan([SeqChunk(i, [out[i][-1]], len(prompts[i]) + s, tables[i], True,
                                  greedy, num_generated=s + 1, adapter_slot=slots[i],
                                  window_table=window_table(runner, i, len(prompts[i]) + s,
                                                            len(prompts[i]) + s + 1))
                         for i in range(len(prompts))])
    return out, logits


def main() -> None:
    which, degrees = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    quant, kv_dtype, lora = FORMATS[sys.argv[3] if len(sys.argv) > 3 else "f32"]
    if which == "embedded":
        from model.weights import load_model

        loaded = load_model("embedded", progress=False)
        cfg, params = loaded.config, loaded.params
    elif which == "gemma":  # 4 KV heads: split whole at 2 and 4 devices
        import dataclasses

        from model.presets import PRESETS
        from model.weights import init_random_params

        cfg = dataclasses.replace(PRESETS["tiny-gemma3"], vocab_size=512, num_heads=8,
                                  num_kv_heads=4, head_dim=16, hidden_size=128,
                                  intermediate_size=256, eos_token_ids=(2,))
        params = init_random_params(cfg, seed=3)
    else:
        # f32: 4 KV heads (no padding at 2 or 4 devices), an intermediate size of 352
        # (padded at 4). Native weights: 6 KV heads of 16 values, so at 2 devices one
        # holds 3 heads (48 query features, not whole 32-value blocks of o's rows): they
        # are padded to 8 KV heads, and 352 to 384 (192 a device, 6 blocks).
        heads = 8 if quant == "none" else 6
        cfg = ModelConfig(name="llama-shaped", vocab_size=512, hidden_size=128,
                          intermediate_size=352, num_layers=2, num_heads=heads,
                          num_kv_heads=heads // 2 if quant == "none" else heads,
                          head_dim=16, max_position=1024, eos_token_ids=(2,))
        from model.weights import init_random_params

        params = init_random_params(cfg, seed=3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, min(cfg.vocab_size, 4000), n).tolist() for n in (5, 23, 40)]
    slots, loads = None, ()
    if lora:  # the 1st prompt under no adapter, the 2nd under "a", the 3rd under "b"
        prompts.append(rng.integers(3, cfg.vocab_size, 17).tolist())  # (a 4th: "a" again)
        slots, loads = [-1, 0, 1, 0], ((0, "a"), (1, "b"))
        from model.lora import load_peft_adapter
        from tests.model.peft import write_peft

        root = tempfile.mkdtemp()
        adapters = []
        for i, name in enumerate(ADAPTERS):  # ranks 4 and 8, every target
            write_peft(f"{root}/{name}", cfg, rank=4 + 4 * i, seed=i)
            adapters.append(load_peft_adapter(f"{root}/{name}", name, cfg, max_rank=8))
    for n in degrees:
        native = quant != "none"
        runner = ModelRunner(cfg, params, page_size=16, num_pages=64, max_context=256,
                             decode_buckets=(4,), prefill_buckets=(128,),
                             mixed_decode_buckets=(0,), max_prefill_seqs=len(prompts), dtype="float32",
                             attention=None if native else "dense", quantization=quant,
                             kv_cache_dtype=kv_dtype,
                             adapter_slots=2 if lora else 0, max_lora_rank=8,
                             native_lora=native if lora else None,
                             devices=jax.devices()[:n])
        for a in adapters if lora else ():
            runner.add_adapter(a)
        runner.warmup()
        tokens, logits = greedy_run(runner, prompts, 12, slots, loads,
                                    every=which != "embedded")
        if lora and n > 1:  # an adapter unloaded and loaded again (another slot's arrays)
            runner.step(StepPlan([], adapter_loads=[(0, "b"), (1, "a")]))
            again, _ = greedy_run(runner, prompts, 12, [-1, 1, 0, 1])
            assert again == tokens, (again, tokens)
        hlo = "\n".join(runner._steps[b].as_text() for b in runner.programs.ready)
        pool = "x".join(map(str, runner.kv[0].shape))
        print(json.dumps({
            "tp": n, "tokens": tokens, "logits": logits,
            "all_reduce": len(re.findall(r"all-reduce\(", hlo)) + len(
                re.findall(r"all-reduce-start\(", hlo)),
            "all_gather": len(re.findall(r"all-gather", hlo)),
            "kv_shards": sorted({tuple(s.data.shape) for s in runner.kv[0].addressable_shards}),
            "pool": pool, "kv_dtype": runner.describe()["kv_cache_dtype"],
            "quantization": runner.quantization, "native": runner.attention.describe().get(
                "native", False),
            "lora_kernel": runner.describe()["lora_kernel"],
        }), flush=True)


if __name__ == "__main__":
    main()
