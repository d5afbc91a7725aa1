"""LoRA's cost per step on this machine: runners with and without adapter slots, interleaved.

Variants on the same random weights of the embedded model's shapes (SmolLM2-135M, f32):
`base` (max_loras = 0: the compiled steps carry no LoRA code), `slots-idle` (4 slots of
rank 16 loaded, every token on the base model: what a pool that serves adapters pays
when none is asked for) and `4-adapters` (the 16 sequences spread over 4 adapters of
rank 16 on all seven projections; on the CPU with the native LoRA kernel, and as
`4-adapters-stacked` with XLA's stacked-mask matmuls). Steps as in cpu_step_ab.py: 16 decodes sharing a
2,000-token system prompt, and 15 decodes beside a 70-token question. Then the same
steps with the system prompt in 4 copies, one per adapter (as the server has it: the
prefix cache keeps an adapter's pages apart, and the keys differ anyway), on the base
runner (`base/4-prefixes`) and with the 4 adapters (`4-adapters/4-prefixes`): what the
CPU backend's cascade, which reads one shared prefix per step, costs then. Prints one
JSON line of median (and fastest) milliseconds per step.

    .venv/bin/python benchmarks/experiments/lora_step_ab.py [--reps 30] [--quantization none]
        [--kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.lora import load_peft_adapter  # noqa: E402
from model.runner import ModelRunner, enable_compilation_cache  # noqa: E402
from model.weights import load_model  # noqa: E402
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan  # noqa: E402
from tests.model.peft import write_peft  # noqa: E402

SYSTEM, SEQS, QUESTION, ADAPTERS, RANK = 2000, 16, 70, 4, 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quantization", default="auto",
                    help="auto (int8 on the CPU, as the server) or none (f32 weights)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="auto (f32 on the CPU) or bfloat16 (bit patterns, native kernels)")
    args = ap.parse_args(argv)
    enable_compilation_cache()
    loaded = load_model("random:smollm2-135m", progress=False)
    cfg = loaded.config

    def runner(slots, native=None):
        r = ModelRunner(cfg, loaded.params, page_size=16, kv_cache_bytes=1 << 30,
                        decode_buckets=[SEQS], prefill_buckets=(80,), dtype="float32",
                        quantization=args.quantization, adapter_slots=slots,
                        kv_cache_dtype=args.kv_cache_dtype,
                        max_lora_rank=RANK, native_lora=native)
        r.warmup()
        return r

    runners = {"base": runner(0), "slots-idle": runner(ADAPTERS)}
    runners["4-adapters"] = runner(ADAPTERS)
    if runners["4-adapters"].lora.native:  # the same, with XLA's stacked-mask matmuls
        runners["4-adapters-stacked"] = runner(ADAPTERS, native=False)
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n for n in runners if n != "base"]:
            r = runners[name]
            for i in range(ADAPTERS):
                write_peft(Path(tmp) / f"a{i}", cfg, rank=RANK, seed=i, std=0.05)
                r.add_adapter(load_peft_adapter(Path(tmp) / f"a{i}", f"a{i}", cfg,
                                                max_rank=RANK))
            r.step(StepPlan([], adapter_loads=[(i, f"a{i}") for i in range(ADAPTERS)]))

    ps = 16
    rng = np.random.default_rng(1)
    own = rng.integers(70, 470, SEQS)
    n_shared = SYSTEM // ps
    prefixes = [list(range(1 + k * n_shared, 1 + (k + 1) * n_shared)) for k in range(ADAPTERS)]
    nxt, tables, split = 1 + ADAPTERS * n_shared + 100, [], []
    for i, n in enumerate(own):
        k = -(-(int(n) + 2 * args.reps + 8) // ps)
        mine = list(range(nxt, nxt + k))
        tables.append(prefixes[0] + mine)
        split.append(prefixes[i % ADAPTERS] + mine)
        nxt += k
    greedy = SamplingParams(temperature=0.0)

    def chunk(name, i, toks, start):
        table = split[i] if name.endswith("4-prefixes") else tables[i]
        c = SeqChunk(seq_id=i, token_ids=toks, start_pos=start, page_table=table,
                     sample=True, sampling=greedy)
        c.adapter_slot = i % ADAPTERS if name.startswith("4-adapters") else -1
        return c

    def decode(name, r, k):
        return r.step(StepPlan([chunk(name, i, [5], SYSTEM + int(own[i]) + k)
                                for i in range(SEQS)]))

    def mixed(name, r, k):
        chunks = [chunk(name, i, [5], SYSTEM + int(own[i]) + k) for i in range(SEQS - 1)]
        chunks.append(chunk(name, SEQS - 1, [7] * QUESTION, SYSTEM))
        return r.step(StepPlan(chunks))

    variants = {**runners, "base/4-prefixes": runners["base"],
                "4-adapters/4-prefixes": runners["4-adapters"]}
    if "4-adapters-stacked" in runners:
        variants["4-adapters-stacked/4-prefixes"] = runners["4-adapters-stacked"]
    for name, r in variants.items():
        decode(name, r, 0)
    times = {n: {"decode": [], "mixed": []} for n in variants}
    for rep in range(args.reps):
        for name, r in variants.items():
            for kind, fn in (("decode", decode), ("mixed", mixed)):
                t = time.perf_counter()
                fn(name, r, 2 + rep)
                times[name][kind].append(time.perf_counter() - t)
    lora = runners["4-adapters"].lora
    out = {"quantization": runners["base"].quantization,
           "lora_kernel": "native" if lora.native else "stacked",
           "kv_cache_dtype": runners["base"].describe()["kv_cache_dtype"],
           "slot_dtype": np.dtype(lora.dtype).name, "seqs": SEQS, "adapters": ADAPTERS, "rank": RANK, "reps": args.reps,
           "targets": "q,k,v,o,gate,up,down",
           "slot_bytes": runners["4-adapters"].lora.nbytes,
           "median_ms": {n: {k: round(1e3 * statistics.median(v), 1) for k, v in t.items()}
                         for n, t in times.items()},
           # the fastest of the reps: steadier than the median on a shared machine
           "min_ms": {n: {k: round(1e3 * min(v), 1) for k, v in t.items()}
                      for n, t in times.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
