"""The CPU cascade over one shared prefix or several, runners side by side in one process.

Random weights of the embedded model's shapes (SmolLM2-135M, f32), 16 sequences after a
2,000-token system prompt: decode steps of 16, and mixed steps (15 decodes beside a
70-token question), with the system prompt in one copy (`/1p`) or in 4 copies, one per
group of rows (`/4p`: four adapters or four customers). Each runner is the CPU backend
with the given attention options (JSON: name -> CpuBackend keyword arguments); the
default compares the cascade of one prefix per step (`max_prefixes` 1, one copy slot)
with the default (4 and 4). Prints one JSON line of median milliseconds per step.

    .venv/bin/python benchmarks/experiments/cascade_prefixes_ab.py [--reps 12] [--variants JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.runner import ModelRunner, enable_compilation_cache  # noqa: E402
from model.weights import load_model  # noqa: E402
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan  # noqa: E402

SYSTEM, SEQS, QUESTION, PREFIXES, PAGE = 2000, 16, 70, 4, 16
DEFAULT = {"one-prefix": {"max_prefixes": 1, "prefix_copies": 1}, "default": {}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--variants", type=json.loads, default=DEFAULT)
    args = ap.parse_args(argv)
    enable_compilation_cache()
    loaded = load_model("random:smollm2-135m", progress=False)
    runners = {}
    for name, options in args.variants.items():
        r = ModelRunner(loaded.config, loaded.params, page_size=PAGE, kv_cache_bytes=1 << 30,
                        decode_buckets=[SEQS], prefill_buckets=(80,), dtype="float32",
                        attention_options=options)
        r.warmup()
        runners[name] = r
    rng = np.random.default_rng(1)
    own = rng.integers(70, 470, SEQS)
    n_shared = SYSTEM // PAGE
    prefixes = [list(range(1 + k * n_shared, 1 + (k + 1) * n_shared)) for k in range(PREFIXES)]
    nxt, tables = 1 + PREFIXES * n_shared + 100, {1: [], PREFIXES: []}
    for i, n in enumerate(own):
        k = -(-(int(n) + 2 * args.reps + 8) // PAGE)
        mine = list(range(nxt, nxt + k))
        tables[1].append(prefixes[0] + mine)
        tables[PREFIXES].append(prefixes[i % PREFIXES] + mine)
        nxt += k
    greedy = SamplingParams(temperature=0.0)

    def chunk(p, i, toks, start):
        return SeqChunk(seq_id=i, token_ids=toks, start_pos=start, page_table=tables[p][i],
                        sample=True, sampling=greedy)

    def decode(p, r, k):
        r.step(StepPlan([chunk(p, i, [5], SYSTEM + int(own[i]) + k) for i in range(SEQS)]))

    def mixed(p, r, k):
        chunks = [chunk(p, i, [5], SYSTEM + int(own[i]) + k) for i in range(SEQS - 1)]
        chunks.append(chunk(p, SEQS - 1, [7] * QUESTION, SYSTEM))
        r.step(StepPlan(chunks))

    variants = {f"{n}/{p}p": (p, r) for n, r in runners.items() for p in (1, PREFIXES)}
    for p, r in variants.values():
        decode(p, r, 0)
        mixed(p, r, 1)
    times = {v: {"decode": [], "mixed": []} for v in variants}
    for rep in range(args.reps):
        for v, (p, r) in variants.items():
            for kind, fn in (("decode", decode), ("mixed", mixed)):
                t = time.perf_counter()
                fn(p, r, 2 + rep)
                times[v][kind].append(time.perf_counter() - t)
    print(json.dumps({"reps": args.reps, "variants": args.variants, "median_ms": {
        v: {k: round(1e3 * statistics.median(x), 1) for k, x in t.items()}
        for v, t in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
