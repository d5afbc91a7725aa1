"""Speculative decoding against plain decoding (scheduler/speculative.py), in process.

The default preset's runner (`config/default.toml`'s pool, the embedded SmolLM2 with its
CPU weights and KV pool), one engine per variant, the same requests, greedy:

- `repeat`: rewriting a given text (a passage, or a code block with one rename): the
  answer repeats the prompt, as edits, summaries that quote and code completion do;
- `chat`: short questions whose answers repeat nothing of the prompt;
- `refused`: the chat questions with a proposer that always guesses a token the model
  never says: nothing is ever accepted, the price of trying (and of the probes the
  policy keeps making) is all there is.

C streams each send `--requests-per-stream` requests one after the other (the
questions in turn). For each (workload, concurrency, mode): output tokens per second
over the run, each
stream's inter-token gaps (p50/p95, the time between tokens as they are committed, a
verify's tokens arriving together), and the proposals' acceptance. The tokens of every
request are compared with the plain run's (`same_tokens`). Prints one JSON line.

    .venv/bin/python benchmarks/speculative.py [--concurrency 1,16] [--workloads repeat,chat]
        [--max-tokens 160] [--requests-per-stream 4] [--rounds 2] [--k 4]
        [--decode-buckets 1,4,8,16,32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import numpy as np
import trio

from config.settings import Settings
from polite_load import REPEAT_PROMPTS
from model.runner import ModelRunner, enable_compilation_cache
from model.weights import load_model
from scheduler.api import FinishEvent, GenerateRequest, TokenEvent
from scheduler.engine import Engine
from scheduler.protocol import SamplingParams

REPEAT = REPEAT_PROMPTS
CHAT = [
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Why is the sky blue?", "Write a haiku about autumn.",
    "How do I boil an egg?", "What is a prime number?",
    "Name two planets bigger than Earth.", "What does a compiler do?",
]


class Refused:
    """Proposes k copies of a token the model never emits (the vocabulary's last)."""

    name = "refused"

    def __init__(self, vocab: int) -> None:
        self.token = vocab - 1

    def propose(self, seq, k: int) -> list[int]:
        return [self.token] * k


def requests(tok, workload: str, n: int) -> list[list[int]]:
    texts = REPEAT if workload == "repeat" else CHAT
    return [tok.encode_chat([{"role": "user", "content": texts[i % len(texts)]}])
            for i in range(n)]


async def run_variant(runner, tok, sched, prompts, max_tokens: int, streams: int,
                      refused: bool = False) -> dict:
    """`streams` clients, each sending its next request when the last one ended, until
    `prompts` are all answered."""
    engine = Engine(runner, tok, sched)
    if refused and engine.scheduler.proposer is not None:
        engine.scheduler.proposer = Refused(runner.config.vocab_size)
    gaps: list[float] = []
    outs: list[list[int]] = [[] for _ in prompts]
    t_first: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        t0 = time.perf_counter()

        async def one(i):
            h = engine.submit(GenerateRequest(prompt_ids=prompts[i], max_tokens=max_tokens,
                                              sampling=SamplingParams(temperature=0.0),
                                              ignore_eos=False))
            last = None
            sent = time.perf_counter()
            async for ev in h.events:
                if isinstance(ev, TokenEvent):
                    now = time.perf_counter()
                    if last is None:
                        t_first.append(now - sent)
                    else:  # tokens that came together: one gap, then zeros
                        gaps.append(now - last)
                        gaps.extend([0.0] * (len(ev.token_ids) - 1))
                    last = now
                    outs[i].extend(ev.token_ids)
                elif isinstance(ev, FinishEvent):
                    break

        todo = iter(range(len(prompts)))

        async def client():
            for i in todo:
                await one(i)

        async with trio.open_nursery() as inner:
            for _ in range(streams):
                inner.start_soon(client)
        wall = time.perf_counter() - t0
        spec = engine.scheduler.spec_stats()
        nursery.cancel_scope.cancel()
    total = sum(len(o) for o in outs)
    g = np.asarray(gaps) if gaps else np.zeros(1)
    return {"tok_s": round(total / wall, 2), "tokens": total, "wall_s": round(wall, 2),
            "itl_p50_ms": round(float(np.percentile(g, 50)) * 1e3, 1),
            "itl_p95_ms": round(float(np.percentile(g, 95)) * 1e3, 1),
            "ttft_p50_s": round(float(np.median(t_first)), 3),
            "acceptance": round(spec["acceptance_rate"], 3),
            "mean_accepted_length": round(spec["mean_accepted_length"], 2),
            "drafts": spec["drafts"], "outputs": outs,
            "decode_step_ms": {n: round(1e3 * (engine.scheduler.cost.decode_time(n) or 0), 1)
                               for n in runner.decode_buckets}}


def _common(a: list[int], b: list[int]) -> int:
    """Length of the common beginning of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--workloads", default="repeat,chat")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="alternating off/ngram runs")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--decode-buckets", default=None,
                    help="the runner's decode buckets (default: the preset's)")
    args = ap.parse_args()
    enable_compilation_cache()
    pool = Settings().pools[0]
    if args.decode_buckets:
        pool = msgspec.structs.replace(
            pool, decode_buckets=[int(x) for x in args.decode_buckets.split(",")],
            scheduler=msgspec.structs.replace(pool.scheduler, speculative="ngram"))
    m = load_model("embedded", progress=False)
    runner = ModelRunner.for_pool(m.config, m.params, pool)
    runner.warmup()
    tok = m.tokenizer
    results = []
    for workload in args.workloads.split(","):
        for c in (int(x) for x in args.concurrency.split(",")):
            prompts = requests(tok, workload, c * args.requests_per_stream)
            runs: dict[str, list[dict]] = {"off": [], "ngram": []}
            for _ in range(args.rounds):
                for mode in ("off", "ngram"):
                    sched = msgspec.structs.replace(pool.scheduler, speculative=mode,
                                                    num_speculative_tokens=args.k,
                                                    ttft_target_s=0.0)
                    runs[mode].append(trio.run(run_variant, runner, tok, sched, prompts,
                                               args.max_tokens, c, workload == "refused"))
            row = {"workload": workload, "concurrency": c}
            for mode, rs in runs.items():
                best = max(rs, key=lambda r: r["tok_s"])
                row[mode] = {k: v for k, v in best.items() if k != "outputs"}
                row[mode]["tok_s_runs"] = [r["tok_s"] for r in rs]
            row["speedup"] = round(row["ngram"]["tok_s"] / row["off"]["tok_s"], 3)
            # int8 weights are not batch-invariant (a row's attention and rounding beside
            # others): batched runs of plain decoding may differ from each other too.
            row["same_tokens"] = all(r["outputs"] == runs["off"][0]["outputs"]
                                     for r in runs["ngram"])
            row["plain_runs_same"] = all(r["outputs"] == runs["off"][0]["outputs"]
                                         for r in runs["off"])
            # Where answers part from the first plain run's: (request, first differing
            # token) of the speculative runs' and of the other plain runs'.
            row["parted"] = {mode: sorted({(i, _common(a, b)) for r in rs[mode == "off":]
                                           for i, (a, b) in enumerate(zip(
                                               r["outputs"], runs["off"][0]["outputs"]))
                                           if a != b})
                             for mode, rs in runs.items()}
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"cases": results, "decode_buckets": pool.decode_buckets,
                      "num_speculative_tokens": args.k}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
