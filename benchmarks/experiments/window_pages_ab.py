"""Sliding layers on KV pages of their own (scheduler/window_pages.py) against one pool
for every layer: the context a KV budget holds and the decode speed, on Gemma 3 270M
(its default formats: int8 weights, int8 KV rows).

    .venv/bin/python benchmarks/experiments/window_pages_ab.py [--kv-gib 1] [--repeats 3]

Builds both runners in one process (the same weights), prints each one's global pages,
sliding pages and KV bytes, then decode tokens/s at 1, 16 and 64 rows at a 512-token
context (`model.bench.bench_decode`), the two alternated, one JSON line per round.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from model.bench import bench_decode
from model.runner import ModelRunner, enable_compilation_cache
from model.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded:gemma3-270m")
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    enable_compilation_cache()
    m = load_model(args.model, progress=False)

    def make(own: bool) -> ModelRunner:
        r = ModelRunner(m.config, m.params, page_size=16, kv_cache_bytes=int(args.kv_gib * 2**30),
                        max_context=4096, decode_buckets=(1, 4, 16, 64),
                        prefill_buckets=(128, 512), mixed_decode_buckets=(0,), dtype="float32",
                        quantization="int8", window_pool=own)
        r.warmup()
        return r

    runners = {"own": make(True), "shared": make(False)}
    print(json.dumps({k: {"global_pages": r.num_pages, "sliding_pages": r.window_pool,
                          "kv_bytes": r.kv_bytes} for k, r in runners.items()}), flush=True)
    rng = np.random.default_rng(0)
    rows = (1, 16, 64)
    out = {k: {b: [] for b in rows} for k in runners}
    for rep in range(args.repeats):
        for k in (["own", "shared"] if rep % 2 == 0 else ["shared", "own"]):
            for b in rows:
                out[k][b].append(round(bench_decode(runners[k], b, 512, 16, rng), 1))
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
