"""What each compiled step shape costs on this machine, beside the shared-prefix workload's
contexts: d decode rows (16 sequences sharing a 2,000-token system prompt, 70-470 tokens of
their own) and p prompt tokens of a question after that system prompt, for every (d, p)
of decode buckets 4, 8, 12, 16 and prefill buckets 16-96. Random weights of the embedded
model's shapes (SmolLM2-135M), quantized and with the KV pool the default preset would
choose (`--quantization`, `--kv-cache-dtype`: "auto", as `sluice serve`). The ITL target plans from exactly these figures: which
shapes fit a target decides how many streams can run beside a prompt chunk. Prints one
JSON object: median milliseconds per step, keyed "d,p".

    .venv/bin/python benchmarks/experiments/step_shapes.py [--reps 7] [--quantization none]
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

DEC, PF = [4, 8, 12, 16], [16, 32, 48, 64, 96]
SYSTEM, SEQS, PS = 2000, 16, 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "q4_1"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args(argv)
    enable_compilation_cache()
    loaded = load_model("random:smollm2-135m", progress=False)
    r = ModelRunner(loaded.config, loaded.params, page_size=PS, kv_cache_bytes=1 << 30,
                    decode_buckets=DEC, prefill_buckets=PF, mixed_decode_buckets=DEC,
                    dtype="float32", quantization=args.quantization,
                    kv_cache_dtype=args.kv_cache_dtype)
    r.warmup()
    rng = np.random.default_rng(1)
    own = rng.integers(70, 470, SEQS)
    shared = list(range(1, 1 + SYSTEM // PS))
    nxt, tables = 1 + len(shared) + 100, []
    for n in own:
        k = -(-(int(n) + 200) // PS)
        tables.append(shared + list(range(nxt, nxt + k)))
        nxt += k
    question = shared + list(range(nxt, nxt + 140))
    greedy = SamplingParams(temperature=0.0)

    def chunk(i, toks, start, table):
        return SeqChunk(seq_id=i, token_ids=toks, start_pos=start, page_table=table,
                        sample=True, sampling=greedy)

    r.step(StepPlan([chunk(i, [5], SYSTEM + int(own[i]), tables[i]) for i in range(SEQS)]))
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for d in DEC:
            for p in [0] + PF:
                chunks = [chunk(i, [5], SYSTEM + int(own[i]) + 1 + rep, tables[i])
                          for i in range(d)]
                if p:
                    chunks.append(chunk(50, [7] * p, SYSTEM, question))
                t = time.perf_counter()
                r.step(StepPlan(chunks))
                times.setdefault(f"{d},{p}", []).append(time.perf_counter() - t)
    print(json.dumps({k: round(1e3 * statistics.median(v), 1) for k, v in times.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
