"""Which decode rows should read a shared prefix through the cascade (CPU backend): the
embedded model's runner (default preset's int8 weights, native decode walk), steps of d
decode rows sharing a 2,000-token system prompt (200 tokens of their own each), with or
without a p-token question chunk after the same prompt, once per `min_prefix_rows`
setting (each runner its own, steps alternating between them). `min_prefix_rows` 1000
means never (every row walks its whole context natively). Median of 5, ms. Prints one
JSON line.

    .venv/bin/python benchmarks/prefix_rows_ab.py [--min-rows 2,8,1000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.runner import ModelRunner  # noqa: E402
from model.weights import load_model  # noqa: E402
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan  # noqa: E402

PS, SYSTEM, OWN = 16, 2000 // 16 * 16, 200
CASES = [(2, 0), (4, 0), (8, 0), (12, 0), (16, 0), (0, 16), (4, 16), (16, 16), (0, 64)]


def plan(decodes: int, chunk: int) -> StepPlan:
    greedy = SamplingParams(temperature=0.0)
    shared = list(range(1, SYSTEM // PS + 1))
    nxt, chunks = SYSTEM // PS + 1, []
    for i in range(decodes):
        own = list(range(nxt, nxt + OWN // PS + 1))
        nxt += len(own)
        chunks.append(SeqChunk(seq_id=i, token_ids=[5], start_pos=SYSTEM + OWN - 1,
                               page_table=shared + own, sample=True, sampling=greedy))
    if chunk:
        own = list(range(nxt, nxt + chunk // PS + 1))
        chunks.append(SeqChunk(seq_id=99, token_ids=[7] * chunk, start_pos=SYSTEM,
                               page_table=shared + own, sample=True, sampling=greedy))
    return StepPlan(chunks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-rows", default="2,8,1000")
    args = ap.parse_args(argv)
    loaded = load_model("embedded", progress=False)
    runners = {}
    for rows in map(int, args.min_rows.split(",")):
        r = ModelRunner(loaded.config, loaded.params, quantization="auto", page_size=PS,
                        kv_cache_bytes=1 << 30, max_context=4096,
                        decode_buckets=(1, 4, 8, 16), prefill_buckets=(16, 64),
                        mixed_decode_buckets=(4, 16), max_prefill_seqs=1,
                        attention_options={"min_prefix_rows": rows})
        r.warmup()
        runners[rows] = r
    out = {}
    for decodes, chunk in CASES:
        p = plan(decodes, chunk)
        for r in runners.values():
            r.step(p)
            r.step(p)
        times: dict[int, list[float]] = {rows: [] for rows in runners}
        for _ in range(5):
            for rows, r in runners.items():
                t = time.perf_counter()
                r.step(p)
                times[rows].append(time.perf_counter() - t)
        out[f"{decodes}+{chunk}"] = {str(rows): round(statistics.median(v) * 1000, 1)
                                     for rows, v in times.items()}
    print(json.dumps({"ms": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
