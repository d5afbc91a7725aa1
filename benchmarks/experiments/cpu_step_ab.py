"""Engine-step A/B on this machine: runner variants measured interleaved in one process.

Timings on the shared 2-core machines drift 10-40% over minutes, so two variants run in
separate processes (or minutes apart) cannot be compared. This builds each variant's
runner on the same random weights of the embedded model's shapes (SmolLM2-135M, f32),
then alternates their steps: a decode step of 16 sequences sharing a 2,000-token system
prompt with 70-470 tokens of their own (the shared-prefix workload at concurrency 16),
a mixed step of 15 of those decodes plus a 70-token question, and a long mixed step (4
decodes, a 48-token chunk of a long prompt 5,000 tokens in, and a question); then, in a
loop of its own, a cold prefill of a 2,000-token prompt in chunks of 256 (8 steps, timed together).
The system prompt is the shared-prefix workload's as the server sees it: 125 whole pages
(its 2,000 tokens are not a whole number of the attention's 1,024-token shared blocks).
Prints one JSON line: median milliseconds per step (per prompt for the prefill) and
variant, and whether the variants' logits agree.

    .venv/bin/python benchmarks/experiments/cpu_step_ab.py [--reps 30]
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

VARIANTS = {
    # Before: every prefill block walked as far as the step's longest one.
    "pf-ungrouped": dict(attention_options=dict(group_prefill_blocks=False)),
    "default": {},
}
SYSTEM, SEQS, QUESTION = 2000, 16, 70
LONG_AT, LONG_CHUNK = 5000, 48


def workload(reps: int, ps: int):
    """The sequences' own prompt lengths (70-470 tokens, seeded) and the steps' page
    tables, pages of `ps` tokens: each sequence's (the system prompt's pages, shared, then
    room for its own tokens and `reps` rounds of decodes), the long prompt's chunk's and
    the cold prefill's, all on distinct pages."""
    rng = np.random.default_rng(1)
    own = rng.integers(70, 470, SEQS)
    shared = list(range(1, 1 + SYSTEM // ps))
    nxt, tables = 1 + len(shared) + 100, []
    for n in own:
        k = -(-(int(n) + 2 * reps + 8) // ps)
        tables.append(shared + list(range(nxt, nxt + k)))
        nxt += k
    long_table = list(range(nxt, nxt + (LONG_AT + LONG_CHUNK) // ps + 1))
    nxt = long_table[-1] + 1
    cold = list(range(nxt, nxt + SYSTEM // ps + 1))
    return own, tables, long_table, cold


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    enable_compilation_cache()
    loaded = load_model("random:smollm2-135m", progress=False)
    runners = {}
    for name, kw in VARIANTS.items():
        r = ModelRunner(loaded.config, loaded.params, page_size=16, kv_cache_bytes=1 << 30,
                        decode_buckets=[4, SEQS], prefill_buckets=(80, 256), dtype="float32",
                        **kw)
        r.warmup([b for b in r.buckets() if b.dec_rows in (0, 4, SEQS)])
        runners[name] = r

    own, tables, long_table, cold = workload(args.reps, ps=16)
    greedy = SamplingParams(temperature=0.0)

    def chunk(i, toks, start):
        return SeqChunk(seq_id=i, token_ids=toks, start_pos=start, page_table=tables[i],
                        sample=True, sampling=greedy)

    def decode(r, k):
        return r.step(StepPlan([chunk(i, [5], SYSTEM + int(own[i]) + k) for i in range(SEQS)]))

    def mixed(r, k, logits=False):
        chunks = [chunk(i, [5], SYSTEM + int(own[i]) + k) for i in range(SEQS - 1)]
        chunks.append(chunk(SEQS - 1, [7] * QUESTION, SYSTEM))
        return r.step(StepPlan(chunks), return_logits=logits)

    # A chunk of a 6,000-token prompt at 5,000 tokens in, beside 4 decodes and a new
    # question (the long-interference workload when a short stream asks again).
    def long_mixed(r, k):
        chunks = [chunk(i, [5], SYSTEM + int(own[i]) + k) for i in range(4)]
        chunks.append(SeqChunk(seq_id=98, token_ids=[9] * LONG_CHUNK, start_pos=LONG_AT,
                               page_table=long_table, sample=False, sampling=greedy))
        chunks.append(chunk(SEQS - 1, [7] * QUESTION, SYSTEM))
        return r.step(StepPlan(chunks))

    for r in runners.values():  # the KV the steps read: written once, same in every pool
        decode(r, 0)
    outs = [mixed(r, 1, logits=True).logits for r in runners.values()]
    diff = max(float(np.abs(outs[0][s] - o[s]).max()) for o in outs[1:] for s in o)

    def prefill(r, k):
        for a in range(0, SYSTEM, 256):
            r.step(StepPlan([SeqChunk(seq_id=99, token_ids=[9] * min(256, SYSTEM - a),
                                      start_pos=a, page_table=cold, sample=True,
                                      sampling=greedy)]))

    times = {n: {"decode": [], "mixed": [], "long_mixed": [], "prefill": []} for n in runners}
    for rep in range(args.reps):
        for name, r in runners.items():
            for kind, fn in (("decode", decode), ("mixed", mixed),
                             ("long_mixed", long_mixed)):
                t = time.perf_counter()
                fn(r, 2 + rep)
                times[name][kind].append(time.perf_counter() - t)
    for rep in range(max(1, args.reps // 10)):
        for name, r in runners.items():
            t = time.perf_counter()
            prefill(r, rep)
            times[name]["prefill"].append(time.perf_counter() - t)
    out = {"seqs": SEQS, "system_tokens": SYSTEM, "question_tokens": QUESTION,
           "reps": args.reps, "max_logit_diff": diff,
           "median_ms": {n: {k: round(1e3 * statistics.median(v), 1) for k, v in t.items()}
                         for n, t in times.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
