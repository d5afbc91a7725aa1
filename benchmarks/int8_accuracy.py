"""int8 weights' accuracy against the f32 path (issue 20): the embedded model answers a
few chat questions greedily in f32 (the path that matches the independent numpy oracle to
1e-5, tests/model/test_real_model.py); both runners then score those exact token
sequences (prompt + answer, teacher-forced, through the prefill steps' prompt logprobs,
model/scoring.py), and at every answer position we compare: does int8's top-1 token
agree with f32's, and how far apart are the two logprobs of the f32 greedy token. The
prompt positions are reported too. The kernel computes each row alike whatever its batch
(tests/model/test_quant.py), so decode steps agree with these prefill scores. Also: how
many tokens int8's own greedy answer shares with f32's before they part. Prints one
JSON line.

    .venv/bin/python benchmarks/int8_accuracy.py [--tokens 64] [--candidate int8-kv-bf16]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from model.runner import ModelRunner
from model.weights import load_model
from scheduler.protocol import SamplingParams, SeqChunk, StepPlan

QUESTIONS = ["What is the capital of France?", "Explain photosynthesis in two sentences.",
             "Write a haiku about the sea.", "List three prime numbers and say why.",
             "How do I reverse a list in Python?", "Who wrote Pride and Prejudice?",
             "Give me a recipe for pancakes.", "Why is the sky blue?"]


def runner(m, quantization: str, dtype: str = "float32", kv: str = "auto") -> ModelRunner:
    r = ModelRunner(m.config, m.params, decode_buckets=(1,), prefill_buckets=(256,),
                    mixed_decode_buckets=(0,), kv_cache_bytes=64 << 20,
                    quantization=quantization, dtype=dtype, kv_cache_dtype=kv)
    r.warmup()
    return r


def greedy(r: ModelRunner, prompt: list[int], n: int) -> list[int]:
    pages = list(range(1, r.num_pages))
    greedy_sp = SamplingParams(temperature=0.0)
    chunk = r.limits.max_prefill_chunk
    out: list[int] = []
    for s in range(0, len(prompt), chunk):
        part = prompt[s:s + chunk]
        res = r.step(StepPlan([SeqChunk(0, part, s, pages, s + len(part) == len(prompt),
                                        greedy_sp)]))
    out.append(res.sampled[0].token_id)
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        res = r.step(StepPlan([SeqChunk(0, [out[-1]], pos, pages, True, greedy_sp,
                                        num_generated=len(out))]))
        out.append(res.sampled[0].token_id)
    return out


def score(r: ModelRunner, ids: list[int]) -> list:
    """Each position's SampledToken for the next token of `ids` (top 1 alternative)."""
    pages = list(range(1, r.num_pages))
    chunk = r.limits.max_prefill_chunk
    scores: list = []
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        c = SeqChunk(1, part, s, pages, s + len(part) == len(ids),
                     SamplingParams(temperature=0.0))
        c.score_targets = [ids[i + 1] if i + 1 < len(ids) else -1
                           for i in range(s, s + len(part))]
        c.score_top = 1
        scores += r.step(StepPlan([c])).prompt_logprobs[1]
    return scores[:-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64, help="answer tokens per question")
    ap.add_argument("--candidate", choices=("int8", "bf16", "kv-bf16", "int8-kv-bf16", "q4_1",
                                            "q4_1-kv-bf16", "kv-int8", "int8-kv-int8"),
                    default="int8",
                    help="bf16: the same comparison for the f32 model run in bfloat16 "
                         "(the GPU's dtype), for scale; kv-bf16: f32 weights, a KV pool "
                         "of bf16 (kv_cache_dtype); int8-kv-bf16: both; q4_1: Q4_1 "
                         "weights x int8 activations (f32 pool), q4_1-kv-bf16 with a "
                         "bf16 pool (the server's); kv-int8: f32 weights, an int8 KV "
                         "pool; int8-kv-int8: int8 weights and KV pool")
    args = ap.parse_args(argv)
    m = load_model("embedded", progress=False)
    f32 = runner(m, "none")
    i8 = {"int8": lambda: runner(m, "int8"),
          "bf16": lambda: runner(m, "none", "bfloat16"),
          "kv-bf16": lambda: runner(m, "none", kv="bfloat16"),
          "int8-kv-bf16": lambda: runner(m, "int8", kv="bfloat16"),
          "q4_1": lambda: runner(m, "q4_1", kv="float32"),
          "q4_1-kv-bf16": lambda: runner(m, "q4_1", kv="bfloat16"),
          "kv-int8": lambda: runner(m, "none", kv="int8"),
          "int8-kv-int8": lambda: runner(m, "int8", kv="int8")}[args.candidate]()
    stats = {"answer": {"agree": [], "dlp": []}, "prompt": {"agree": [], "dlp": []}}
    same = []  # tokens int8's greedy answer shares with f32's before the first difference
    for q in QUESTIONS:
        prompt = m.tokenizer.encode_chat([{"role": "user", "content": q}])
        answer = greedy(f32, prompt, args.tokens)
        own = greedy(i8, prompt, args.tokens)
        same.append(next((i for i, (x, y) in enumerate(zip(answer, own)) if x != y),
                         len(answer)))
        ids = prompt + answer
        a, b = score(f32, ids), score(i8, ids)
        for pos, (x, y) in enumerate(zip(a, b)):
            part = stats["answer" if pos >= len(prompt) - 1 else "prompt"]
            part["agree"].append(x.top_logprobs[0].token_id == y.top_logprobs[0].token_id)
            part["dlp"].append(abs(x.logprob - y.logprob))
    out = {"questions": len(QUESTIONS), "answer_tokens": args.tokens,
           "greedy_answer_same_tokens": same,
           "candidate": args.candidate,
           "int8_weight_bytes": i8.describe()["int8_weight_bytes"]}
    for name, s in stats.items():
        d = np.asarray(s["dlp"])
        out[name] = {"positions": len(d), "top1_agreement": round(float(np.mean(s["agree"])), 4),
                     "logprob_diff_max": round(float(d.max()), 4),
                     "logprob_diff_mean": round(float(d.mean()), 5),
                     "logprob_diff_p99": round(float(np.percentile(d, 99)), 4)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
